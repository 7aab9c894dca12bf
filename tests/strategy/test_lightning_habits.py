"""Lightning as users use it, on 2 real processes (gloo): callbacks, loggers, checkpoints, prediction writers,
manual optimization with two optimizers, gradient clipping and LR schedulers, around a user-written model with
fused (in-backward) tables. Each launch runs several scenarios; every test asserts exact numbers.

The scenarios are in :mod:`tests.helpers.habit_scenarios`.
"""

from __future__ import annotations

import csv
import json
import math
from typing import Any

import pytest
import torch

from tests.helpers import habit_scenarios
from tests.helpers.dist import run_ranks
from tests.helpers.models import assemble

pytestmark = pytest.mark.dist

STEPS_PER_EPOCH, MAX_EPOCHS, PATIENCE, MIN_DELTA, TOP_K, CLIP, LR = 4, 12, 2, 0.0, 2, 0.1, 0.05
PREDICT_ROWS = 24


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    out = tmp_path_factory.mktemp("habits")
    results = run_ranks(
        habit_scenarios.callbacks_and_loggers,
        2,
        out,
        steps_per_epoch=STEPS_PER_EPOCH,
        max_epochs=MAX_EPOCHS,
        patience=PATIENCE,
        min_delta=MIN_DELTA,
        top_k=TOP_K,
        clip=CLIP,
        lr=LR,
        predict_rows=PREDICT_ROWS,
    )
    return out, results


def _stop_index(history: list[float], patience: int, min_delta: float) -> int | None:
    """The validation (0-based) at which EarlyStopping(mode="min") stops, by its documented rule (None: never)."""
    best, wait = math.inf, 0
    for i, value in enumerate(history):
        if value < best - min_delta:
            best, wait = value, 0
        else:
            wait += 1
            if wait >= patience:
                return i
    return None


def _expected_stop(history: list[float], patience: int, min_delta: float) -> int:
    stop = _stop_index(history, patience, min_delta)
    assert stop is not None, f"no early stop in {history}: the scenario must stop before max_epochs"
    return stop


def test_early_stopping_stops_every_rank_at_the_step_patience_implies(fitted):
    _, (r0, r1) = fitted
    synced = [[(h["step"], h["val_loss"]) for h in r["val_history"]] for r in (r0, r1)]
    assert synced[0] == synced[1]  # sync_dist=True: one value on every rank
    history = [h["val_loss"] for h in r0["val_history"]]
    assert min(history[1:]) < history[0]  # it improved before it stopped improving
    stop = _expected_stop(history, PATIENCE, MIN_DELTA)
    assert stop < MAX_EPOCHS - 1
    assert len(history) == stop + 1  # no validation after the stop
    for r in (r0, r1):
        assert r["global_step"] == (stop + 1) * STEPS_PER_EPOCH
        assert r["stopped_epoch"] == stop


def test_early_stopping_on_a_rank_local_metric_stops_every_rank_together(fitted):
    """Each rank monitors the loss on its own rows (no sync_dist): their own decisions differ, and Lightning's
    reduction through the strategy makes every rank stop when the first one's patience runs out."""
    _, results = fitted
    own = [_stop_index([h["val_loss_local"] for h in r["local_stop"]["history"]], 1, 0.0) for r in results]
    assert len(set(own)) > 1, own  # one rank alone would have stopped elsewhere (or never)
    first = min(i for i in own if i is not None)
    for r in results:
        assert len(r["local_stop"]["history"]) == first + 1
        assert r["local_stop"]["global_step"] == (first + 1) * STEPS_PER_EPOCH


def test_model_checkpoint_keeps_top_k_and_validate_best_reproduces_it(fitted):
    _, (r0, r1) = fitted
    history = {h["step"]: h["val_loss"] for h in r0["val_history"]}
    best_step = min(history, key=history.get)
    top = sorted(history.values())[:TOP_K]
    for r in (r0, r1):
        assert len(r["ckpt_dir_entries"]) == TOP_K  # pruned on disk, not only in the callback's book-keeping
        assert sorted(name.rsplit("/", 1)[-1] for name in r["best_k_models"]) == r["ckpt_dir_entries"]
        assert sorted(r["best_k_models"].values()) == top
        assert r["best_model_score"] == history[best_step]
        assert r["best_model_path"].endswith(f"-step={best_step}.ckpt")
        # validate(ckpt_path="best") loads the best weights back into the sharded model: the same value, exactly,
        # although the weights at the end of fitting scored otherwise.
        assert r["validated_best"] == r["best_model_score"]
        assert history[max(history)] != r["best_model_score"]


def _csv_scalars(path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("epoch", "step") and value != "":
                    out.setdefault(key, {})[int(row["step"])] = float(value)
    return out


def test_tensorboard_and_csv_log_the_same_scalars(fitted):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, (r0, _) = fitted
    events = EventAccumulator(str(out / "logs" / "tb" / "version_0"))
    events.Reload()
    tags = ("train_loss", "val_loss", "val_loss_local")
    tb = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in tags}
    logged = _csv_scalars(out / "logs" / "csv" / "version_0" / "metrics.csv")
    for tag in tags:
        assert tb[tag] == logged[tag], tag
    assert sorted(tb["train_loss"]) == list(range(r0["global_step"]))  # log_every_n_steps=1: every step
    # Lightning logs a validation at the step before the next one; the values are the synced ones.
    fit_vals = [h["val_loss"] for h in r0["val_history"]]
    assert [tb["val_loss"][h["step"] - 1] for h in r0["val_history"]] == fit_vals


def test_gradient_clip_val_warns_and_clips_the_dense_gradients(fitted):
    _, (r0, r1) = fitted
    assert len(r0["warnings"]) == 1 and "gradient_clip_val applies to the dense parameters only" in r0["warnings"][0]
    assert r1["warnings"] == []  # said once, by rank 0
    for r in (r0, r1):
        unclipped, clipped = r["unclipped"], r["clipped"]
        assert len(unclipped) == len(clipped) == r["global_step"]
        assert any(u > CLIP for u in unclipped) and any(u < CLIP for u in unclipped)
        assert clipped == pytest.approx([min(u, CLIP) for u in unclipped], rel=1e-5)
    assert r0["clipped"] == r1["clipped"]  # clipped after DDP's all-reduce: the same gradients everywhere


def test_prediction_writer_writes_every_ranks_rows(fitted):
    out, (r0, _) = fitted
    files = sorted((out / "predictions").iterdir())
    assert {f.name.split(".")[0] for f in files} == {"rank0", "rank1"}
    by_index: dict[int, float] = {}
    for f in files:
        written = json.loads(f.read_text())
        for index, logit in zip(written["indices"], written["logits"]):
            assert index not in by_index, "a row predicted twice"
            by_index[index] = logit
    assert sorted(by_index) == list(range(PREDICT_ROWS))
    # The union equals one process predicting every row with the best checkpoint (validate(best) loaded it).
    assert [by_index[i] for i in range(PREDICT_ROWS)] == pytest.approx(r0["single_process_logits"], abs=1e-6)


def test_val_check_interval_mid_epoch_checkpoint_resumes_exactly(tmp_path):
    r0, r1 = run_ranks(
        habit_scenarios.mid_epoch_resume, 2, tmp_path, steps_per_epoch=6, epochs=2, every=3, resume_step=3
    )
    for r in (r0, r1):
        assert r["saved"] == [
            "epoch=0-step=3.ckpt",
            "epoch=0-step=6.ckpt",
            "epoch=1-step=12.ckpt",
            "epoch=1-step=9.ckpt",
        ]
        assert r["full_step"] == r["resumed_step"] == 12
        assert len(r["full_losses"]) == 12 and len(r["resumed_losses"]) == 9
        assert r["resumed_losses"] == pytest.approx(r["full_losses"][3:], abs=1e-6)
        assert r["resume_warnings"] == []


def _tables(per_rank: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return assemble([{n: [(o, torch.tensor(t)) for o, t in shards] for n, shards in r.items()} for r in per_rank])


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    return run_ranks(habit_scenarios.optimizers_and_schedulers, 2, tmp_path_factory.mktemp("optimizers"), steps=6)


def _global_losses(per_rank: list[dict[str, Any]]) -> list[float]:
    """Each step's whole-batch loss: the mean of the ranks' losses on their equal shares."""
    return [sum(step) / len(step) for step in zip(*(r["losses"] for r in per_rank))]


def test_manual_optimization_with_adam_and_rowwise_adagrad_matches_plain_pytorch(optimized):
    ref = optimized[0]["manual"]["reference"]
    for r in optimized:
        assert r["manual"]["global_step"] == 2 * 6  # Lightning counts every optimizer's step in manual optimization
    assert _global_losses([r["manual"] for r in optimized]) == pytest.approx(ref["losses"], abs=1e-6)
    tables = _tables([r["manual"]["tables"] for r in optimized])
    for name, expected in ref["tables"].items():
        torch.testing.assert_close(tables[f"ebc.{name}"], torch.tensor(expected), atol=1e-5, rtol=0, msg=name)


def test_lr_scheduler_moves_the_learning_rate_the_fbgemm_kernels_use(optimized):
    ref, unscheduled = optimized[0]["scheduled"]["reference"], optimized[0]["unscheduled"]
    expected_lrs = [2.0 * 0.1 ** (step // 2) for step in range(6)]  # StepLR(step_size=2, gamma=0.1), per step
    for r in optimized:
        lrs = r["scheduled"]["tbe_lrs"]
        assert all(len(step) >= 1 for step in lrs)  # every table-batched kernel this rank runs
        for step, kernels in enumerate(lrs):
            assert kernels == pytest.approx([expected_lrs[step]] * len(kernels), rel=1e-6), step
    assert _global_losses([r["scheduled"] for r in optimized]) == pytest.approx(ref["losses"], abs=1e-6)
    tables = _tables([r["scheduled"]["tables"] for r in optimized])
    for name, expected in ref["tables"].items():
        # The table updates follow the decayed rate (the plain-PyTorch rule: w -= lr_t * grad) ...
        torch.testing.assert_close(tables[f"ebc.{name}"], torch.tensor(expected), atol=1e-5, rtol=0, msg=name)
    # ... which matters: without the scheduler the tables end elsewhere.
    moved = max((tables[f"ebc.{n}"] - torch.tensor(t)).abs().max().item() for n, t in unscheduled["tables"].items())
    assert moved > 1e-2


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    return run_ranks(habit_scenarios.features, 1, tmp_path_factory.mktemp("features"))[0]


@pytest.mark.parametrize(
    "case, expected",
    [
        ("swa", ["does not support the StochasticWeightAveraging callback", "HINT:"]),
        ("ema", ["does not support the EMAWeightAveraging callback", "HINT:"]),
        ("accumulation_scheduler", ["GradientAccumulationScheduler(scheduling={0: 1, 1: 2})", "HINT:"]),
        ("pruning", ["does not support the ModelPruning callback", "HINT:", "torch.nn.utils.prune"]),
        ("frozen", ["'ebc.embedding_bags.t_user.weight'", "requires_grad=False", "silently train", "HINT:", "lr=0.0"]),
        ("finetuning", ["requires_grad=False", "HINT:"]),  # BaseFinetuning.freeze(ebc): BackboneFinetuning's way
        ("accumulate", ["accumulate_grad_batches=2", "HINT:"]),
    ],
)
def test_features_that_cannot_work_are_refused_before_anything_changes(features, case, expected):
    result = features[case]
    assert result["error"] is not None and result["error"].startswith("ValueError: RecShardStrategy")
    for text in expected:
        assert text in result["error"]
    assert not result["sharded"] and result["tables_unchanged"] and result["global_step"] == 0


@pytest.mark.parametrize("case, failing_batch, steps", [("skip_steps", 2, 2), ("manual_every_other", 1, 0)])
def test_a_backward_pass_without_an_optimizer_step_is_refused_at_the_next_batch(features, case, failing_batch, steps):
    """An `optimizer_step` override that runs the closure but skips the step (automatic optimization), or manual
    optimization stepping every other batch: the tables updated in that backward pass, the dense layers did not."""
    result = features[case]
    assert result["error"].startswith(
        f"RuntimeError: RecShardStrategy: the training batch before batch {failing_batch} ran a backward pass but no "
        "optimizer step."
    )
    assert "HINT:" in result["error"]
    assert result["global_step"] == steps


def test_toggle_optimizer_is_refused_with_a_clear_error(features):
    result = features["toggle_optimizer"]
    assert result["error"].startswith("RuntimeError: RecShardStrategy does not support `toggle_optimizer`")
    assert "HINT:" in result["error"] and result["global_step"] == 0 and not result["tables_moved"]


def test_features_that_work_with_fused_tables(features):
    # The refusal's HINT: tables fixed by a zero learning rate while the dense layers train.
    fixed = features["fixed_tables"]
    assert fixed["error"] is None and not fixed["tables_moved"] and fixed["dense_moved"]
    # detect_anomaly: trains (FBGEMM's backward has no NaN checks to trip on finite values).
    assert features["anomaly"]["error"] is None and features["anomaly"]["global_step"] == 4
    assert features["anomaly"]["tables_moved"]
    # gradient_clip_algorithm="value": the same warning (dense gradients only).
    clip = features["clip_value"]
    assert clip["error"] is None and len(clip["warnings"]) == 1 and "dense parameters only" in clip["warnings"][0]
    # ReduceLROnPlateau (per epoch, on val_loss): the kernels' rate halves with the dense one.
    plateau = features["plateau"]
    assert plateau["error"] is None
    assert [lr for (lr,) in plateau["tbe_lrs"]] == pytest.approx([0.1] * 4 + [0.05] * 4 + [0.025] * 4, rel=1e-6)
    # LearningRateFinder: the kernels follow its sweep, then the weights are restored before training starts.
    finder = features["lr_finder"]
    assert finder["error"] is None and finder["restored_after_fit_start"]
    swept, trained = [lr for (lr,) in finder["tbe_lrs"][:4]], [lr for (lr,) in finder["tbe_lrs"][4:]]
    assert swept[0] == pytest.approx(1e-8, rel=1e-6) and swept == sorted(swept) and swept[-1] > 1e3 * swept[0]
    assert trained == pytest.approx([finder["suggestion"] or 0.1] * 4, rel=1e-6)
