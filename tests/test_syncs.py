"""Host-device synchronisations per training step, counted on CPU (lightning_rec.testing.SyncCounter): a guard for
a GPU property. Issue 14's target is zero added by recshard; today the input checks add the four listed here, and
nothing else in the package may add one."""

from __future__ import annotations

import pytest
import torch

from lightning_rec.testing import SyncCounter
from tests.helpers.dist import run_ranks

# Where recshard syncs today, each once per step: the KJT checks at the tables' door (lengths/ids summary, id
# ranges), the dense-input check in batch_to_device, the loss check before backward.
KNOWN = {"check_batch", "_summary", "_check_id_ranges", "check_finite"}


@pytest.mark.parametrize("pipeline", [False, True])
def test_recshard_syncs_only_where_its_input_checks_do(tmp_path, pipeline):
    res = run_ranks("tests.helpers.user_scenarios:syncs", 1, tmp_path, pipeline=pipeline)[0]
    assert res["user"] == 1.0, res["origins"]  # the model's own loss.item(): the counter sees what runs
    assert set(res["lightning_rec_functions"]) <= KNOWN, res["origins"]
    assert res["lightning_rec"] <= len(KNOWN), res["origins"]


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
