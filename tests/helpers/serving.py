"""Running serving artifacts the way a serving host would: in a fresh Python process where ``torchrec``,
``lightning`` and ``lightning_rec`` cannot be imported (an import hook refuses them), through ``examples/serve.py``
(torch + fbgemm_gpu only)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from tests.helpers.data import REPO

FORBIDDEN = ("torchrec", "lightning", "lightning_rec")

# The fresh process: refuse the forbidden packages, serve every (artifact, inputs, output), then prove none of
# them was imported (not even by FBGEMM or TorchScript's loading).
_FRESH = f"""
import runpy, sys
FORBIDDEN = {FORBIDDEN!r}
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FORBIDDEN:
            raise ImportError("a serving host has no " + name)
sys.meta_path.insert(0, Refuse())
serve = runpy.run_path({str(REPO / "examples" / "serve.py")!r})["main"]
jobs = sys.argv[1:]
for i in range(0, len(jobs), 3):
    serve(*jobs[i : i + 3])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
assert not loaded, loaded
print("SERVED WITHOUT", FORBIDDEN)
"""


def serve_fresh(jobs: Sequence[tuple[Path, Sequence[tuple[torch.Tensor, ...]]]], work: Path) -> list[torch.Tensor]:
    """Each artifact's outputs on its batches of arguments, computed in one fresh process (see the module)."""
    argv: list[str] = []
    for i, (artifact, batches) in enumerate(jobs):
        inputs = work / f"serve_inputs{i}.pt"
        torch.save(list(batches), inputs)
        argv += [str(artifact), str(inputs), str(work / f"serve_outputs{i}.pt")]
    out = subprocess.run([sys.executable, "-c", _FRESH, *argv], capture_output=True, text=True, timeout=300, cwd=work)
    assert out.returncode == 0 and "SERVED WITHOUT" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    return [torch.load(work / f"serve_outputs{i}.pt") for i in range(len(jobs))]
