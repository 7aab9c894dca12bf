"""Lightning as users use it, on 2 real processes (gloo): callbacks, loggers, checkpoints, prediction writers,
manual optimization with two optimizers, gradient clipping and LR schedulers, around a user-written model with
fused (in-backward) tables. Each launch runs several scenarios; every test asserts exact numbers.

The scenarios (what each rank runs) are at the end of this module. Every rank takes its share of every global batch
(``rank_share``) and reports plain numbers; the tests compare them with each other and with plain-PyTorch
references computed there on whole batches.
"""

from __future__ import annotations

import copy
import csv
import gc
import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
from lightning.pytorch.callbacks import BasePredictionWriter, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader
from torchrec.optim import RowWiseAdagrad

from lightning_rec import RecShardStrategy
from lightning_rec._compat import ShardedTensor
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.dist import run_ranks
from tests.helpers.models import assemble, local_weights
from tests.helpers.user_models import TABLE_WISE_PLAN, ValuesModel, global_batches, rank_share, samples, to_batch

pytestmark = pytest.mark.dist

STEPS_PER_EPOCH, MAX_EPOCHS, PATIENCE, MIN_DELTA, TOP_K, CLIP, LR = 4, 12, 2, 0.0, 2, 0.1, 0.05
PREDICT_ROWS = 24


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    out = tmp_path_factory.mktemp("habits")
    results = run_ranks(
        callbacks_and_loggers,
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
    r0, r1 = run_ranks(mid_epoch_resume, 2, tmp_path, steps_per_epoch=6, epochs=2, every=3, resume_step=3)
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
    return run_ranks(optimizers_and_schedulers, 2, tmp_path_factory.mktemp("optimizers"), steps=6)


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
    return run_ranks(feature_cases, 1, tmp_path_factory.mktemp("features"))[0]


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


# ===============================================================================================================
# What each rank runs (run_ranks imports them from this module).
# ===============================================================================================================

VAL_SEED, PREDICT_SEED = 99, 123


def table_kernels(module: torch.nn.Module) -> list[SplitTableBatchedEmbeddingBagsCodegen]:
    """The FBGEMM table-batched kernels that hold ``module``'s table shards on this rank.

    A sharded EBC keeps its lookups (and their kernels) out of ``modules()``, and reaching them takes private
    TorchRec attributes; instead, the live kernels are found among all objects and matched to the module by the memory
    of their weights (what ``split_embedding_weights()`` returns is what the module's sharded state_dict views)."""
    storages = {
        shard.tensor.untyped_storage().data_ptr()
        for t in module.state_dict().values()
        if isinstance(t, ShardedTensor)
        for shard in t.local_shards()
    }
    return [
        k
        for k in gc.get_objects()
        if isinstance(k, SplitTableBatchedEmbeddingBagsCodegen)
        and any(w.untyped_storage().data_ptr() in storages for w in k.split_embedding_weights())
    ]


def _local_tables(model: torch.nn.Module) -> dict[str, list[Any]]:
    """This rank's table shards: ``{name: [[offsets, rows], ...]}`` (JSON)."""
    return {
        n: [[o, t.tolist()] for o, t in shards] for n, shards in local_weights(model).items() if n.startswith("ebc.")
    }


def _dense_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if not n.startswith("ebc.")]


class HabitModel(ValuesModel):
    """:class:`ValuesModel` + what a user adds for Lightning's habits: ``train_loss`` and a validation metric
    ``val_loss`` logged with ``sync_dist=True``, an optimizer choice, an optional ``StepLR`` (per step) and manual
    optimization with two optimizers (``Adam`` for the dense part, ``RowWiseAdagrad`` for the tables)."""

    def __init__(
        self,
        seed: int = 7,
        lr: float = 0.05,
        optimizer: str = "adagrad",
        step_lr: dict[str, float] | None = None,
        manual: bool = False,
        dense_lr: float = 0.01,
        fmt: str = "dict",
        batchnorm: bool = False,
    ) -> None:
        super().__init__(seed=seed, lr=lr, fmt=fmt, batchnorm=batchnorm)
        self.save_hyperparameters()
        self.automatic_optimization = not manual
        self.kernels: list[Any] | None = None
        self.tbe_lrs: list[list[float]] = []  # per step: what the kernels use in this step's backward
        self.dense_grad_norms: list[float] = []  # per step, after the step (what the optimizer used)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.kernels is None:
            self.kernels = table_kernels(self)
        self.tbe_lrs.append([k.get_learning_rate() for k in self.kernels])
        if self.automatic_optimization:
            loss = super().training_step(batch, batch_idx)
        else:
            opt_dense, opt_tables = self.optimizers()
            opt_dense.zero_grad()
            opt_tables.zero_grad()
            loss = F.binary_cross_entropy_with_logits(self(batch), batch["label"])
            self.losses.append(loss.item())
            self.manual_backward(loss)
            opt_dense.step()
            opt_tables.step()
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = F.binary_cross_entropy_with_logits(self(batch), batch["label"])
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_loss_local", loss)  # this rank's own rows only: another value on every rank

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        if hp.manual:
            return [
                torch.optim.Adam(_dense_params(self), lr=hp.dense_lr),
                RowWiseAdagrad(self.ebc.parameters(), lr=hp.lr),
            ]
        opt = (torch.optim.SGD if hp.optimizer == "sgd" else torch.optim.Adagrad)(self.parameters(), lr=hp.lr)
        if hp.step_lr is None:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=int(hp.step_lr["step_size"]), gamma=hp.step_lr["gamma"])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _trainer(world_size: int, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=world_size,
        **QUIET_TRAINER,
    )
    defaults.update(kwargs)
    if any(isinstance(c, ModelCheckpoint) for c in defaults.get("callbacks", [])):
        defaults["enable_checkpointing"] = True
    return L.Trainer(strategy=RecShardStrategy(constraints=TABLE_WISE_PLAN), **defaults)


def _loader(batches: Sequence[Sequence[dict[str, Any]]], rank: int, world_size: int) -> DataLoader:
    return DataLoader([to_batch(rank_share(b, rank, world_size)) for b in batches], batch_size=None)


def _reference(
    model: HabitModel,
    batches: Sequence[Sequence[dict[str, Any]]],
    make_optimizers: Any,
    step_lr: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Plain PyTorch on whole batches: per-step losses and the final tables."""
    model = copy.deepcopy(model)
    optimizers = make_optimizers(model)
    scheds = (
        [torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=int(step_lr["step_size"]), gamma=step_lr["gamma"])]
        if step_lr
        else []
    )
    losses = []
    for rows in batches:
        batch = to_batch(rows)
        for o in optimizers:
            o.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(batch), batch["label"])
        loss.backward()
        for o in optimizers:
            o.step()
        for s in scheds:
            s.step()
        losses.append(loss.item())
    return {"losses": losses, "tables": {k: v.tolist() for k, v in model.ebc.state_dict().items()}}


# ---------------------------------------------------------------------------------------------------------------
# 1. EarlyStopping + ModelCheckpoint(top-k) + TensorBoard/CSV + gradient clipping; validate/predict from "best".
# ---------------------------------------------------------------------------------------------------------------


class _Recorder(L.Callback):
    """Per validation: the synced ``val_loss`` and the step; per step: the dense gradient norm before clipping."""

    def __init__(self) -> None:
        self.val_history: list[dict[str, float]] = []
        self.unclipped: list[float] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            metrics = trainer.callback_metrics
            self.val_history.append(
                {
                    "step": trainer.global_step,
                    "val_loss": float(metrics["val_loss"]),
                    "val_loss_local": float(metrics["val_loss_local"]),
                }
            )

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.unclipped.append(_grad_norm(pl_module))  # Lightning clips after this hook

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        pl_module.dense_grad_norms.append(_grad_norm(pl_module))  # the gradients the optimizer stepped with


def _grad_norm(module: torch.nn.Module) -> float:
    grads = [p.grad for p in _dense_params(module) if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0


class _RowWriter(BasePredictionWriter):
    """Writes each rank's predicted rows (with their dataset indices) as JSON, one file per batch."""

    def __init__(self, out: Path) -> None:
        super().__init__(write_interval="batch")
        self.out = out

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):  # noqa: D102
        path = self.out / f"rank{trainer.global_rank}.batch{batch_idx}.json"
        path.write_text(json.dumps({"indices": list(batch_indices), "logits": prediction.tolist()}))


def callbacks_and_loggers(
    rank: int,
    world_size: int,
    out_dir: Path,
    steps_per_epoch: int = 4,
    max_epochs: int = 12,
    lr: float = 0.5,
    patience: int = 2,
    min_delta: float = 0.0,
    clip: float = 0.05,
    top_k: int = 2,
    predict_rows: int = 24,
    batch_size: int = 128,
) -> dict[str, Any]:
    """Fit with EarlyStopping(val_loss), ModelCheckpoint(val_loss, top-k), TensorBoard + CSV loggers and
    ``gradient_clip_val``; then ``validate(ckpt_path="best")`` and ``predict`` with a prediction writer
    (Lightning's distributed sampler). Rank 0 also predicts the same rows from the best checkpoint, unsharded, in
    one process."""
    L.seed_everything(0)
    model = HabitModel(lr=lr)
    batches = global_batches(steps_per_epoch, batch_size)
    val = _loader(global_batches(2, 32, seed=VAL_SEED), rank, world_size)
    ckpt_dir = out_dir / "best"
    stopper = EarlyStopping(monitor="val_loss", mode="min", patience=patience, min_delta=min_delta)
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, monitor="val_loss", mode="min", save_top_k=top_k, filename="{epoch}-{step}"
    )
    recorder = _Recorder()
    loggers = [
        CSVLogger(out_dir / "logs", name="csv", version=0),
        TensorBoardLogger(out_dir / "logs", name="tb", version=0),
    ]
    trainer = _trainer(
        world_size,
        max_epochs=max_epochs,
        callbacks=[stopper, checkpoint, recorder],
        logger=loggers,
        log_every_n_steps=1,
        gradient_clip_val=clip,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader(batches, rank, world_size), val)
    fit_result = {
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "stopped_epoch": stopper.stopped_epoch,
        "val_history": recorder.val_history,
        "unclipped": recorder.unclipped,
        "clipped": model.dense_grad_norms,
        "best_model_path": checkpoint.best_model_path,
        "best_model_score": float(checkpoint.best_model_score),
        "best_k_models": {k: float(v) for k, v in checkpoint.best_k_models.items()},
        "ckpt_dir_entries": sorted(p.name for p in ckpt_dir.iterdir()),
        "warnings": [str(w.message) for w in caught if "gradient_clip_val" in str(w.message)],
    }
    validated = trainer.validate(model, val, ckpt_path="best", verbose=False)[0]["val_loss"]

    # EarlyStopping on a metric each rank computes on its own rows: the ranks disagree on when to stop, and every
    # rank must still stop at the same step (as soon as one rank's patience runs out).
    local_recorder = _Recorder()
    local = _trainer(
        world_size,
        max_epochs=max_epochs,
        callbacks=[EarlyStopping(monitor="val_loss_local", patience=1), local_recorder],
    )
    local.fit(HabitModel(lr=lr), _loader(batches, rank, world_size), val)
    fit_result["local_stop"] = {"history": local_recorder.val_history, "global_step": local.global_step}

    rows = samples(predict_rows, PREDICT_SEED)
    pred_dir = out_dir / "predictions"
    pred_dir.mkdir(exist_ok=True)
    predictor = _trainer(world_size, callbacks=[_RowWriter(pred_dir)], use_distributed_sampler=True)
    predictor.predict(model, DataLoader(rows, batch_size=4, collate_fn=to_batch), return_predictions=False)
    result = {**fit_result, "validated_best": validated}
    if rank == 0:
        single = HabitModel.load_from_checkpoint(checkpoint.best_model_path)
        single.eval()
        with torch.no_grad():
            result["single_process_logits"] = single(to_batch(rows)).tolist()
    return result


# ---------------------------------------------------------------------------------------------------------------
# 2. val_check_interval mid-epoch and an exact resume from a mid-epoch checkpoint.
# ---------------------------------------------------------------------------------------------------------------


class ResumableBatches:
    """A user's resumable training data (``state_dict``/``load_state_dict``, as Lightning asks for mid-epoch
    resumption): Lightning stores its position in every checkpoint and restores it when resuming."""

    def __init__(self, batches: Sequence[Any]) -> None:
        self.batches = list(batches)
        self.served = 0  # batches handed out in the current epoch
        self._resume_at = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        start, self._resume_at = self._resume_at, 0
        self.served = start
        for batch in self.batches[start:]:
            self.served += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"served": self.served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_at = state["served"]


def mid_epoch_resume(
    rank: int,
    world_size: int,
    out_dir: Path,
    steps_per_epoch: int = 6,
    epochs: int = 2,
    every: int = 3,
    resume_step: int = 3,
) -> dict[str, Any]:
    """An uninterrupted fit validating every ``every`` steps (a checkpoint at each validation, kept), then a fresh
    model (other rows) resumed from the mid-epoch checkpoint of step ``resume_step``: both runs' per-step losses."""
    batches = [to_batch(rank_share(b, rank, world_size)) for b in global_batches(steps_per_epoch, 16)]
    val = _loader(global_batches(1, 16, seed=VAL_SEED), rank, world_size)
    ckpt_dir = out_dir / "mid"

    def run(model: HabitModel, ckpt_path: Path | None) -> L.Trainer:
        checkpoint = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, filename="{epoch}-{step}")
        trainer = _trainer(world_size, max_epochs=epochs, val_check_interval=every, callbacks=[checkpoint])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, ResumableBatches(batches), val, ckpt_path=ckpt_path)
        run.warnings = [str(w.message) for w in caught if "resum" in str(w.message)]  # type: ignore[attr-defined]
        return trainer

    L.seed_everything(0)
    full = HabitModel(lr=0.2)
    full_trainer = run(full, None)
    saved = sorted(p.name for p in ckpt_dir.iterdir())
    resumed = HabitModel(seed=1234, lr=0.2)
    path = ckpt_dir / f"epoch={(resume_step - 1) // steps_per_epoch}-step={resume_step}.ckpt"
    resumed_trainer = run(resumed, path)
    return {
        "saved": saved,
        "full_losses": full.losses,
        "resumed_losses": resumed.losses,
        "full_step": full_trainer.global_step,
        "resumed_step": resumed_trainer.global_step,
        "resume_warnings": run.warnings,  # type: ignore[attr-defined]
    }


# ---------------------------------------------------------------------------------------------------------------
# 3. Manual optimization with two optimizers; an LR scheduler seen by the FBGEMM kernels.
# ---------------------------------------------------------------------------------------------------------------


def _fit_and_reference(
    rank: int,
    world_size: int,
    model: HabitModel,
    steps: int,
    make_optimizers: Any,
    step_lr: dict[str, float] | None = None,
) -> dict[str, Any]:
    batches = global_batches(steps, 16)
    result: dict[str, Any] = {}
    if rank == 0:
        result["reference"] = _reference(model, batches, make_optimizers, step_lr)
    trainer = _trainer(world_size, max_epochs=1)  # manual optimization counts a global step per optimizer step
    trainer.fit(model, _loader(batches, rank, world_size))
    return {
        **result,
        "losses": model.losses,
        "global_step": trainer.global_step,
        "tbe_lrs": model.tbe_lrs,
        "tables": _local_tables(model),
    }


def optimizers_and_schedulers(rank: int, world_size: int, out_dir: Path, steps: int = 6) -> dict[str, Any]:
    """(a) manual optimization, ``[Adam(dense), RowWiseAdagrad(tables)]``; (b) fused SGD under ``StepLR`` (per step),
    each with its plain-PyTorch reference on whole batches (rank 0)."""
    L.seed_everything(0)
    manual = _fit_and_reference(
        rank,
        world_size,
        HabitModel(lr=0.1, manual=True, dense_lr=0.02),
        steps,
        lambda m: [torch.optim.Adam(_dense_params(m), lr=0.02), RowWiseAdagrad(m.ebc.parameters(), lr=0.1)],
    )
    step_lr = {"step_size": 2, "gamma": 0.1}
    scheduled = _fit_and_reference(
        rank,
        world_size,
        HabitModel(lr=2.0, optimizer="sgd", step_lr=step_lr),
        steps,
        lambda m: [torch.optim.SGD(m.parameters(), lr=2.0)],
        step_lr,
    )
    unscheduled = (
        _reference(
            HabitModel(lr=2.0, optimizer="sgd"),
            global_batches(steps, 16),
            lambda m: [torch.optim.SGD(m.parameters(), lr=2.0)],
        )
        if rank == 0
        else None
    )
    return {"manual": manual, "scheduled": scheduled, "unscheduled": unscheduled}


# ---------------------------------------------------------------------------------------------------------------
# 4. Other Lightning features: refused before anything changes, or working with fused tables.
# ---------------------------------------------------------------------------------------------------------------


def _table_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every table tensor this rank holds (unsharded: the module's own; sharded: the local shards), cloned."""
    out = {}
    for name, t in model.state_dict().items():
        if name.startswith("ebc."):
            shards = [s.tensor for s in t.local_shards()] if isinstance(t, ShardedTensor) else [t]
            out[name] = torch.cat([s.detach().flatten().clone() for s in shards])
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _SkipEveryOtherStep(HabitModel):
    """Gradient accumulation by hand in automatic optimization: the closure runs every batch, the step every other."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if batch_idx % 2 == 0:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()


class _ManualEveryOther(HabitModel):
    """Manual optimization that steps every other batch (backward every batch)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def configure_optimizers(self) -> Any:
        return torch.optim.Adagrad(self.parameters(), lr=self.hparams.lr)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(self(batch), batch["label"])
        self.manual_backward(loss)
        if batch_idx % 2 == 1:
            self.optimizers().step()
            self.optimizers().zero_grad()
        return loss


class _Toggling(HabitModel):
    """Manual optimization with two optimizers, toggling the dense one around its loss (a GAN-style habit)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt_dense, _ = self.optimizers()
        self.toggle_optimizer(opt_dense)
        loss = F.binary_cross_entropy_with_logits(self(batch), batch["label"])
        self.manual_backward(loss)
        opt_dense.step()
        opt_dense.zero_grad()
        self.untoggle_optimizer(opt_dense)
        return loss


class _FrozenTables(HabitModel):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ebc.requires_grad_(False)


class _FixedTables(HabitModel):
    """What the refusal's HINT says: tables kept fixed by a zero learning rate, the dense layers train."""

    def configure_embedding_optimizer(self) -> Any:
        from lightning_rec import EmbeddingOptimizer

        return EmbeddingOptimizer("sgd", lr=0.0)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adagrad(_dense_params(self), lr=self.hparams.lr)


class _Plateau(HabitModel):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adagrad(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, factor=0.5, patience=0, threshold=10.0
        )  # halves per epoch
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}


class _Snapshots(L.Callback):
    """The tables when fitting starts (before any callback's ``on_fit_start``) and when training starts."""

    def __init__(self) -> None:
        self.at_fit_start: dict[str, torch.Tensor] | None = None
        self.at_train_start: dict[str, torch.Tensor] | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at_fit_start = _table_values(pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at_train_start = _table_values(pl_module)
        self.dense_at_train_start = [p.detach().clone() for p in _dense_params(pl_module)]


def feature_cases(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    """Each case: a fresh model fitted 4 steps (or 3 epochs) with one Lightning feature; reports its error (``None``
    if none), whether the model was sharded and its tables changed when it failed, and what the case measures."""
    from lightning.pytorch.callbacks import (
        BaseFinetuning,
        EMAWeightAveraging,
        GradientAccumulationScheduler,
        LearningRateFinder,
        ModelPruning,
        StochasticWeightAveraging,
    )

    from lightning_rec._strategy.dmp import sharded_state

    class FreezeTables(BaseFinetuning):  # BackboneFinetuning's mechanism, with the tables as the backbone
        def freeze_before_training(self, pl_module: Any) -> None:
            self.freeze(pl_module.ebc)

        def finetune_function(self, pl_module: Any, epoch: int, optimizer: Any) -> None:
            pass

    train = _loader(global_batches(4, 16), rank, world_size)
    val = _loader(global_batches(1, 16, seed=VAL_SEED), rank, world_size)

    def case(model: HabitModel, epochs: int | None = None, **trainer_kwargs: Any) -> dict[str, Any]:
        L.seed_everything(0)
        snapshots = _Snapshots()
        trainer_kwargs["callbacks"] = [snapshots, *trainer_kwargs.get("callbacks", [])]
        trainer = _trainer(world_size, **({"max_epochs": epochs} if epochs else {"max_steps": 4}), **trainer_kwargs)
        before = _table_values(model)
        error = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                trainer.fit(model, train, val)
            except Exception as e:  # noqa: BLE001 - the refusal is what is measured
                error = f"{type(e).__name__}: {e}"
        sharded = sharded_state(model) is not None
        trained = snapshots.at_train_start is not None
        return {
            "tables_moved": trained and not _same(snapshots.at_train_start, _table_values(model)),
            "dense_moved": trained
            and not all(torch.equal(a, b) for a, b in zip(snapshots.dense_at_train_start, _dense_params(model))),
            "error": error,
            "sharded": sharded,
            "global_step": trainer.global_step,
            "tables_unchanged": None if sharded else _same(before, _table_values(model)),
            "restored_after_fit_start": None
            if snapshots.at_train_start is None
            else _same(snapshots.at_fit_start, snapshots.at_train_start),
            "tbe_lrs": model.tbe_lrs,
            "warnings": [str(w.message) for w in caught if "RecShardStrategy" in str(w.message)],
        }

    out: dict[str, Any] = {}
    out["swa"] = case(HabitModel(lr=0.1), epochs=3, callbacks=[StochasticWeightAveraging(swa_lrs=0.01)])
    out["ema"] = case(HabitModel(lr=0.1), callbacks=[EMAWeightAveraging()])
    out["accumulation_scheduler"] = case(
        HabitModel(lr=0.1), epochs=3, callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})]
    )
    out["pruning"] = case(HabitModel(lr=0.1), epochs=2, callbacks=[ModelPruning("l1_unstructured", amount=0.5)])
    out["frozen"] = case(_FrozenTables(lr=0.1))
    out["finetuning"] = case(HabitModel(lr=0.1), callbacks=[FreezeTables()])
    out["accumulate"] = case(HabitModel(lr=0.1), accumulate_grad_batches=2)
    out["skip_steps"] = case(_SkipEveryOtherStep(lr=0.1))
    out["manual_every_other"] = case(_ManualEveryOther(lr=0.1))
    out["toggle_optimizer"] = case(_Toggling(lr=0.1, manual=True))
    # What works:
    fixed = _FixedTables(lr=0.1)
    out["fixed_tables"] = case(fixed)
    out["anomaly"] = case(HabitModel(lr=0.1), detect_anomaly=True)
    out["clip_value"] = case(HabitModel(lr=0.1), gradient_clip_val=0.01, gradient_clip_algorithm="value")
    out["plateau"] = case(_Plateau(lr=0.1), epochs=3)
    finder = LearningRateFinder(num_training_steps=8)
    out["lr_finder"] = case(HabitModel(lr=0.1), epochs=1, callbacks=[finder])
    out["lr_finder"]["suggestion"] = finder.optimal_lr.suggestion() if finder.optimal_lr is not None else None
    return out
