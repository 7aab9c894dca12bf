"""Host-device synchronisations per training step, counted on CPU (lightning_rec.testing.SyncCounter): a guard for
a GPU property. A recshard step syncs no more often than the hand-written TorchRec loop of the same model: its
input checks read batches on the host before the copy, and the loss one step late from host memory."""

from __future__ import annotations

import pytest
import torch

from lightning_rec.testing import SyncCounter
from tests.helpers.dist import run_ranks
from tests.helpers import user_scenarios

SYNCS = user_scenarios.syncs


@pytest.mark.dist
@pytest.mark.parametrize(
    "fmt, pipeline, ranks",
    [("batch", False, 1), ("batch", True, 1), ("dict", False, 1), ("dict", True, 1), ("batch", False, 2)],
)
def test_a_recshard_step_syncs_no_more_than_the_hand_written_torchrec_loop(tmp_path, fmt, pipeline, ranks):
    """Same model, plan, optimizers and batches; the raw loop is TorchRec's tutorial loop (TrainPipelineSparseDist
    when pipelined, on TorchRec ``Batch``es: TorchRec's pipeline takes no dicts). Rank 0's counts."""
    ours = run_ranks(SYNCS, ranks, tmp_path, pipeline=pipeline, fmt=fmt)[0]
    raw = run_ranks(SYNCS, ranks, tmp_path, pipeline=pipeline, fmt="batch", loop="raw")[0]
    # With several ranks Lightning's own loop broadcasts a SIGTERM flag from rank 0 and reads it every step (the same
    # under strategy="ddp"): Lightning's sync, not recshard's; it is named here, so that nothing else can hide in it.
    lightnings = ours["lightning_loop"] if ranks > 1 else 0
    assert lightnings in (0, 1) and (ranks == 1 or ours["lightning_loop_functions"] == ["_broadcast_sigterm_tensor"])
    ours["by_op"]["_local_scalar_dense"] -= lightnings
    ops = set(ours["by_op"]) | set(raw["by_op"])
    assert all(ours["by_op"].get(op, 0) <= raw["by_op"].get(op, 0) for op in ops), (ours["origins"], raw["origins"])
    assert ours["lightning_rec_functions"] == [], ours["origins"]
    # The counter sees the step (torch's Adagrad, the model's loss.item()); with one rank recshard leaves out DMP's
    # DDP, whose backward adds syncs of its own to the raw loop.
    assert ours["per_step"] >= 5


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
