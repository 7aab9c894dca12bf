"""Multi-process (gloo) tests of RecShardStrategy: real processes, numbers compared."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.models import assemble

from tests.helpers.scenarios import MIXED_PLAN as CONSTRAINTS


def _weights(tmp_path, tag, world_size):
    return assemble([torch.load(tmp_path / f"{tag}.weights{r}.pt", weights_only=False) for r in range(world_size)])


def test_two_process_training_matches_handwritten_torchrec_loop(tmp_path):
    """Same model, plan, data and initial weights: recshard == DMP + CombinedOptimizer by hand."""
    steps = 8
    ours = run_ranks("train", 2, tmp_path, tag="recshard", steps=steps, strategy={"constraints": CONSTRAINTS})
    ref = run_ranks("reference", 2, tmp_path, plan_from="recshard", steps=steps)
    for rank in range(2):
        assert len(ours[rank]["losses"]) == steps
        assert ours[rank]["losses"] == pytest.approx(ref[rank]["losses"], abs=1e-5)
    assert ref[0]["kernels"] == ["dense", "fused"]
    assert {r["table"]: (r["sharding_type"], r["compute_kernel"]) for r in ours[0]["plan"]} == {
        "t_user": ("column_wise", "fused"),
        "t_item": ("table_wise", "fused"),
        "t_genre": ("data_parallel", "dense"),  # TorchRec keeps replicated tables on a dense kernel
    }
    a, b = _weights(tmp_path, "recshard", 2), _weights(tmp_path, "reference", 2)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0, msg=name)
    # Embedding parameters are owned by the fused optimizer only: the dense optimizer never saw them.
    assert not ours[0]["dense_has_fused"]
    assert ours[0]["dense_param_count"] == 4  # the mlp's 2 weights + 2 biases
    assert ours[0]["num_model_params"] == 5  # + the data_parallel table, updated by the table optimizer


@pytest.mark.parametrize("world_size", [1, 2])
def test_loss_falls_on_a_learnable_task(tmp_path, world_size):
    res = run_ranks("train", world_size, tmp_path, steps=40, batch_size=64, model={"lr": 0.2})
    for r in res:
        first, last = sum(r["losses"][:5]) / 5, sum(r["losses"][-5:]) / 5
        assert last < 0.75 * first, r["losses"]


def test_closure_runs_exactly_once_per_step_and_lr_scheduler_moves_tables(tmp_path):
    steps = 6
    res = run_ranks("train", 2, tmp_path, steps=steps, model={"scheduler": {"gamma": 0.5}, "lr": 0.4})
    for r in res:
        assert r["global_step"] == steps
        assert r["closure_calls"] == steps
        # training_step sees the fused lr that this step's backward uses: halved every step, like the dense lr
        assert r["fused_lrs"] == pytest.approx([0.4 * 0.5**i for i in range(steps)])
        assert r["dense_lr"] == pytest.approx(0.4 * 0.5**steps)


def test_all_loops_and_collectives(tmp_path):
    res = run_ranks("loops", 2, tmp_path)
    for rank, r in enumerate(res):
        assert r["closure_calls_after_fit"] == 4 and r["closure_calls_end"] == 4, "eval must not train"
        assert r["weights_unchanged_by_eval"]
        assert r["num_predictions"] == 2 * 16 and r["predictions_in_range"]
        assert r["reduce"] == {"sum": 3.0, "mean": 1.5, "max": 2.0, "min": 1.0}
        assert r["all_gather"] == [0, 10]
        assert r["broadcast_from_last"] == {"from": 1}
        assert r["is_global_zero"] == (rank == 0)
    # sync_dist=True: the logged value is the mean over ranks of each rank's own mean loss
    expected = (res[0]["local_val_mean"] + res[1]["local_val_mean"]) / 2
    assert res[0]["val_loss"] == pytest.approx(expected, abs=1e-5)
    assert res[1]["val_loss"] == pytest.approx(expected, abs=1e-5)
    assert res[0]["test_loss"] == pytest.approx(expected, abs=1e-5)
