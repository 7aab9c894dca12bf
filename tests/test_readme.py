"""The README's quickstart is an excerpt of examples/quickstart.py, which trains on 2 processes through Lightning's
own launcher (the popen launcher re-runs the script for rank 1), logging the plan the README shows."""

from __future__ import annotations

import collections
import re
import subprocess
import sys

import pytest

from lightning_rec.checkpoint import is_checkpoint
from tests.helpers.dist import REPO


def _readme_block() -> str:
    text = (REPO / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_readme_quickstart_is_an_excerpt_of_the_example_file():
    """The front page shows the model (about 20 lines); every line of it is examples/quickstart.py's, in order, so
    what it shows is what the script (run below, and shown whole in docs/quickstart.md) trains."""
    shown = [line for line in _readme_block().splitlines() if line.strip()]
    script = [line for line in (REPO / "examples" / "quickstart.py").read_text().splitlines() if line.strip()]
    assert 15 <= len(shown) <= 25, len(shown)
    at = script.index(shown[0])
    assert script[at : at + len(shown)] == shown


@pytest.mark.dist
def test_quickstart_trains_on_two_processes_and_saves_a_sharded_checkpoint(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text((REPO / "examples" / "quickstart.py").read_text())
    proc = subprocess.run(
        [sys.executable, str(script), "--devices", "2", "--max-epochs", "2", "--root-dir", str(tmp_path / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    loss = float(re.search(r"final train_loss=([0-9.]+)", proc.stdout).group(1))
    assert loss < 0.4  # starts at ~0.69
    ckpt = tmp_path / "run" / "checkpoints" / re.search(r"checkpoint=.*/(.*)", proc.stdout).group(1)
    assert is_checkpoint(ckpt)
    assert {p.name.split("_")[2] for p in ckpt.glob("*.distcp")} == {"0", "1"}  # both ranks wrote their shards
    # The plan the README shows is the one this run logs.
    shown = re.search(r"rank 0 logs the plan.*?\n```\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    for line in shown.strip().splitlines():
        assert line in proc.stdout + proc.stderr, line
    # A quiet console (issue 44) on this row-wise run: no FutureWarning (torch's for TorchRec's row-wise collectives
    # included), and no log line twice, from one rank or from each ("[rank: 1] " prefixes dropped before comparing).
    assert "FutureWarning" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    logged = [re.sub(r"^\[rank: \d+\] ", "", line) for line in proc.stderr.splitlines()]
    repeated = {line for line, n in collections.Counter(logged).items() if n > 1 and line.strip("- ")}
    assert not repeated, repeated
