"""What an export costs in memory (issue 45, item 8): the checkpoint is read straight into the module's own tables
(one copy of each table, not the module's, the checkpoint's and DCP's read buffer), and the export quantizes the
network itself (no copy of it), so that a TorchScript export peaks under 2x the tables' fp32 size above the process's
imports, where it peaked at 3.3x. Measured in fresh processes on a 400,000 x 64 table (98 MB); the 5M x 64 figures,
and the ``.pt2`` compile's own, are in BENCHMARKS.md ("Serving costs", ``benchmarks/serving_costs.py``). The load
of a ``.pt2`` package (no compiler, nothing left unpacked) is tested in ``test_serving_pt2.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_rec.checkpoint import _export as checkpoint_export
from lightning_rec.models import DLRMModule
from tests.test_serving import trained_checkpoint

ROWS, DIM = 400_000, 64
TABLE = ROWS * DIM * 4

# A fresh process: every module imported first, then one step measured by its peak resident memory (VmHWM) above the
# resident memory before it (VmRSS), as JSON on its last line.
_MEASURE = """
import json, sys
import torch
from lightning_rec.checkpoint._export import load_module
from lightning_rec.models import DLRMModule
from lightning_rec.serving import export_inference
import lightning_rec.serving.pt2, torchrec.quant.embedding_modules, torchrec.inference.modules

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

before = status("VmRSS")
if sys.argv[2] == "load":
    module = load_module(DLRMModule, sys.argv[1])
else:
    export_inference(sys.argv[1], sys.argv[3], table_dtype="int8")
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


@pytest.fixture(scope="module")
def big_table_checkpoint(tmp_path_factory) -> Path:
    """A DLRM with a 400,000 x 64 table (and a small one), trained one step on one process."""
    from lightning_rec.data import SyntheticDataModule, SyntheticTable

    dm = SyntheticDataModule(
        [SyntheticTable("big", ROWS), SyntheticTable("small", 100)],
        num_dense_features=4,
        train_rows=64,
        val_rows=64,
        batch_size=64,
    )
    dm.setup("fit")
    module = DLRMModule(
        dm.sparse_features, 4, embedding_dim=DIM, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[8, 1]
    )
    return trained_checkpoint(module, list(dm.train_dataloader())[:1], tmp_path_factory.mktemp("big") / "ckpt")


def _peak_above_start(ckpt: Path, step: str, tmp_path: Path) -> float:
    """The peak resident memory of ``step`` in a fresh process, above what it held before, over the table's size."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(ckpt), step, str(tmp_path / "model.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    return (got["peak"] - got["before"]) / TABLE


@pytest.mark.dist
def test_a_checkpoint_is_read_into_the_modules_own_tables(big_table_checkpoint, monkeypatch):
    """``load_module`` gives exactly what DCP reads, and each table is read straight into the module's tensor (not
    loaded beside it by DCP and copied)."""
    read_in_place: list[tuple[tuple[int, ...], bool]] = []
    read_whole = checkpoint_export._read_whole

    def spy(stored, target, req):
        done = read_whole(stored, target, req)
        read_in_place.append((tuple(target.shape), done))
        return done

    monkeypatch.setattr(checkpoint_export, "_read_whole", spy)
    module = checkpoint_export.load_module(DLRMModule, big_table_checkpoint)
    state = module.state_dict()
    assert ((ROWS, DIM), True) in read_in_place
    assert all(done for _, done in read_in_place), read_in_place

    import torch.distributed.checkpoint as dcp

    from lightning_rec.checkpoint import _layout as layout
    from lightning_rec.checkpoint import _safe_io as safe_io

    def read(pinned):
        metadata = safe_io.read_metadata(pinned)
        prefix = layout.MODEL_PREFIX
        targets = {
            k: torch.empty(md.size, dtype=md.properties.dtype)
            for k, md in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and hasattr(md, "properties")
        }
        dcp.load(targets, storage_reader=safe_io.SafeFileSystemReader(pinned), no_dist=True)
        return {k[len(prefix) :]: t for k, t in targets.items()}

    reference = checkpoint_export.with_pinned(big_table_checkpoint, read)
    assert set(reference) <= set(state)
    for key, tensor in reference.items():
        assert torch.equal(state[key], tensor), key


@pytest.mark.dist
def test_loading_and_exporting_a_big_table_hold_one_float_copy_of_it(big_table_checkpoint, tmp_path):
    """Fresh processes: ``load_module`` peaks at ~1x the table above its start (it was 3x: the module's tables, the
    checkpoint's, DCP's read buffer), an int8 TorchScript export under 2x (3.3x: and a copy of the network)."""
    load = _peak_above_start(big_table_checkpoint, "load", tmp_path)
    assert load < 1.5, f"load_module peaked at {load:.2f}x the table above its start"
    export = _peak_above_start(big_table_checkpoint, "export", tmp_path)
    assert export < 2.0, f"an int8 TorchScript export peaked at {export:.2f}x the table above its start"
