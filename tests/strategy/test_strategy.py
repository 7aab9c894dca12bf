"""Multi-process (gloo) tests of RecShardStrategy: real processes, numbers compared."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import scenarios
from tests.helpers.dist import run_ranks
from tests.helpers.models import saved_weights
from tests.helpers.scenarios import MIXED_PLAN as CONSTRAINTS

pytestmark = pytest.mark.dist


def test_two_process_training_matches_handwritten_torchrec_loop(tmp_path):
    """Same model, plan, data and initial weights: recshard == DMP + CombinedOptimizer by hand."""
    steps = 8
    ours = run_ranks(scenarios.train, 2, tmp_path, tag="recshard", steps=steps, strategy={"constraints": CONSTRAINTS})
    ref = run_ranks(scenarios.reference, 2, tmp_path, plan_from="recshard", steps=steps)
    for rank in range(2):
        assert len(ours[rank]["losses"]) == steps
        assert ours[rank]["losses"] == pytest.approx(ref[rank]["losses"], abs=1e-5)
    assert ref[0]["kernels"] == ["dense", "fused"]
    assert {r["table"]: (r["sharding_type"], r["compute_kernel"]) for r in ours[0]["plan"]} == {
        "t_user": ("column_wise", "fused"),
        "t_item": ("table_wise", "fused"),
        "t_genre": ("data_parallel", "dense"),  # TorchRec keeps replicated tables on a dense kernel
    }
    a, b = saved_weights(tmp_path, "recshard", 2), saved_weights(tmp_path, "reference", 2)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0, msg=name)
    # Embedding parameters are owned by the fused optimizer only: the dense optimizer never saw them.
    assert not ours[0]["dense_has_fused"]
    assert ours[0]["dense_param_count"] == 4  # the mlp's 2 weights + 2 biases
    assert ours[0]["num_model_params"] == 5  # + the data_parallel table, updated by the table optimizer


@pytest.mark.parametrize("world_size", [1, 2])
def test_loss_falls_on_a_learnable_task(tmp_path, world_size):
    res = run_ranks(scenarios.train, world_size, tmp_path, steps=40, batch_size=64, model={"lr": 0.2})
    for r in res:
        first, last = sum(r["losses"][:5]) / 5, sum(r["losses"][-5:]) / 5
        assert last < 0.75 * first, r["losses"]


def test_closure_runs_exactly_once_per_step_and_lr_scheduler_moves_tables(tmp_path):
    steps = 6
    res = run_ranks(scenarios.train, 2, tmp_path, steps=steps, model={"scheduler": {"gamma": 0.5}, "lr": 0.4})
    for r in res:
        assert r["global_step"] == steps
        assert r["closure_calls"] == steps
        # training_step sees the fused lr that this step's backward uses: halved every step, like the dense lr
        assert r["fused_lrs"] == pytest.approx([0.4 * 0.5**i for i in range(steps)])
        assert r["dense_lr"] == pytest.approx(0.4 * 0.5**steps)


def test_all_loops_and_collectives(tmp_path):
    res = run_ranks(scenarios.loops, 2, tmp_path)
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


def test_manual_optimization_matches_automatic(tmp_path):
    auto = run_ranks(scenarios.train, 2, tmp_path, tag="auto", steps=6)
    manual = run_ranks(scenarios.train, 2, tmp_path, tag="manual", steps=6, model={"manual": True})
    for a, m in zip(auto, manual):
        assert m["global_step"] == 6
        assert m["losses"] == pytest.approx(a["losses"], abs=1e-6)


def test_batch_formats_workers_nested_ec_and_cpu_tables(tmp_path):
    """A dict batch from DataLoader workers, tables built on CPU, an EmbeddingCollection two levels down:
    same numbers as Batch objects with meta tables."""
    base = run_ranks(scenarios.train, 2, tmp_path, tag="base", steps=5, model={"with_ec": True})
    other = run_ranks(
        scenarios.train,
        2,
        tmp_path,
        tag="other",
        steps=5,
        num_workers=2,
        model={"with_ec": True, "batch_format": "dict", "table_device": "cpu"},
    )
    assert {r["table"] for r in base[0]["plan"]} == {"t_user", "t_item", "t_genre", "t_tag"}
    assert {r["module"] for r in base[0]["plan"]} == {"ebc", "towers.inner.ec"}
    for b, o in zip(base, other):
        assert o["losses"] == pytest.approx(b["losses"], abs=1e-6)
    tup = run_ranks(scenarios.train, 1, tmp_path, tag="tuple", steps=3, model={"batch_format": "tuple"})
    assert len(tup[0]["losses"]) == 3


def test_bf16_mixed_trains(tmp_path):
    res = run_ranks(
        scenarios.train, 1, tmp_path, steps=30, batch_size=64, model={"lr": 0.2}, trainer={"precision": "bf16-mixed"}
    )
    losses = res[0]["losses"]
    assert all(l == l for l in losses)  # no NaN
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_clear_errors_for_what_cannot_run_on_cpu(tmp_path):
    cases = [
        {"model": {"optimizer": "adam"}},  # Adam has no fused CPU kernel
        {"model": {"optimizer": "sgd_momentum"}},  # FBGEMM's SGD has no momentum
        {"model": {"emb_optimizer": {"name": "lamb"}}},  # declared, CUDA-only
        {"trainer": {"accumulate_grad_batches": 2}},
    ]
    errors = run_ranks(scenarios.fit_errors, 1, tmp_path, cases=cases)[0]["errors"]
    assert "'adam' has no FBGEMM kernel on CPU" in errors[0] and "sgd, adagrad, rowwise_adagrad" in errors[0]
    assert "momentum" in errors[1] and "configure_embedding_optimizer" in errors[1]
    assert "'lamb' has no FBGEMM kernel on CPU" in errors[2]
    assert "accumulate_grad_batches=2" in errors[3]


def test_model_without_tables_falls_back_to_data_parallel(tmp_path):
    res = run_ranks(scenarios.dense_only, 2, tmp_path)
    assert res[0]["warned"]  # rank_zero_warn: said once, by rank 0
    assert res[0]["global_step"] == 20
    assert res[0]["weights"] == pytest.approx(res[1]["weights"])  # replicas stay in sync
    assert res[0]["weights"][0] > 0.5  # learned that feature 0 decides the label


def test_validate_before_fit_shards_once_with_the_derived_optimizer(tmp_path):
    res = run_ranks(scenarios.validate_then_fit, 2, tmp_path)
    for r in res:
        assert r["steps"] == 4
        assert r["fused_lrs"] == pytest.approx([0.3] * 4)  # derived from configure_optimizers at validate time
        assert r["after"] < r["before"]
