"""Host-device synchronisations per training step, counted on CPU (lightning_rec.testing.SyncCounter): a guard for
a GPU property. A recshard step syncs exactly as often as the hand-written TorchRec loop of the same model: its
input checks read batches on the host before the copy, and the loss one step late from host memory."""

from __future__ import annotations

import pytest
import torch

from lightning_rec.testing import SyncCounter
from tests.helpers.dist import run_ranks

SYNCS = "tests.helpers.user_scenarios:syncs"


@pytest.mark.parametrize("fmt, pipeline", [("batch", False), ("batch", True), ("dict", False), ("dict", True)])
def test_a_recshard_step_syncs_no_more_than_the_hand_written_torchrec_loop(tmp_path, fmt, pipeline):
    """Same model, plan, optimizers and batches; the raw loop is TorchRec's tutorial loop (TrainPipelineSparseDist
    when pipelined, on TorchRec ``Batch``es: TorchRec's pipeline takes no dicts)."""
    ours = run_ranks(SYNCS, 1, tmp_path, pipeline=pipeline, fmt=fmt)[0]
    raw = run_ranks(SYNCS, 1, tmp_path, pipeline=pipeline, fmt="batch", loop="raw")[0]
    assert ours["by_op"] == raw["by_op"], (ours["origins"], raw["origins"])
    assert ours["lightning_rec_functions"] == [], ours["origins"]
    assert ours["per_step"] >= 9  # the counter sees the step: torch's backward and Adagrad, the model's loss.item()


def test_the_counter_counts_item_bool_nonzero_and_tolist():
    original = torch.Tensor.tolist
    with SyncCounter() as syncs:
        t = torch.tensor([0.0, 1.0, 2.0])
        _ = t.sum().item()
        _ = bool(t.max() > 1)
        _ = t.nonzero()
        _ = t.tolist()
        _ = t * 2  # no sync
        syncs.active = False
        _ = t.sum().item()  # paused
    assert syncs.count == 4
    assert sorted(op for op, _ in syncs.origins) == ["_local_scalar_dense", "_local_scalar_dense", "nonzero", "tolist"]
    assert syncs.count_from("test_syncs.py") == 4
    assert torch.Tensor.tolist is original  # restored on exit
