"""Lightning's callbacks and loggers around a sharded fit, on 2 real processes (gloo): EarlyStopping (synced and
rank-local metrics), ModelCheckpoint top-k and ``validate(ckpt_path="best")``, TensorBoard and CSV loggers, gradient
clipping and a prediction writer, around a user-written model with fused (in-backward) tables. One launch runs the
whole scenario; every test asserts exact numbers.

This module also holds what every ``test_lightning_*`` module's ranks use: :class:`HabitModel` (the user's model with
Lightning's habits), :func:`habit_trainer` and :func:`rank_loader`. Loops and optimizers (mid-epoch resume, manual
optimization, LR schedulers) are in ``test_lightning_loops.py``; the features refused up front (and those that work
with fused tables) in ``test_lightning_refusals.py``.

The scenarios (what each rank runs) are at the end of this module. Every rank takes its share of every global batch
(``rank_share``) and reports plain numbers; the tests compare them with each other and with plain-PyTorch
references computed there on whole batches.
"""

from __future__ import annotations

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


def dense_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """``model``'s parameters outside its tables (``ebc``)."""
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
                torch.optim.Adam(dense_params(self), lr=hp.dense_lr),
                RowWiseAdagrad(self.ebc.parameters(), lr=hp.lr),
            ]
        opt = (torch.optim.SGD if hp.optimizer == "sgd" else torch.optim.Adagrad)(self.parameters(), lr=hp.lr)
        if hp.step_lr is None:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=int(hp.step_lr["step_size"]), gamma=hp.step_lr["gamma"])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def habit_trainer(world_size: int, **kwargs: Any) -> L.Trainer:
    """A quiet CPU Trainer on ``world_size`` devices with a table-wise :class:`RecShardStrategy`; ``kwargs`` override
    its settings (checkpointing is enabled when a ``ModelCheckpoint`` is among the callbacks)."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=world_size,
        **QUIET_TRAINER,
    )
    defaults.update(kwargs)
    if any(isinstance(c, ModelCheckpoint) for c in defaults.get("callbacks", [])):
        defaults["enable_checkpointing"] = True
    return L.Trainer(strategy=RecShardStrategy(constraints=TABLE_WISE_PLAN), **defaults)


def rank_loader(batches: Sequence[Sequence[dict[str, Any]]], rank: int, world_size: int) -> DataLoader:
    """This rank's share of every global batch in ``batches``, one batch per step."""
    return DataLoader([to_batch(rank_share(b, rank, world_size)) for b in batches], batch_size=None)


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
    grads = [p.grad for p in dense_params(module) if p.grad is not None]
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
    val = rank_loader(global_batches(2, 32, seed=VAL_SEED), rank, world_size)
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
    trainer = habit_trainer(
        world_size,
        max_epochs=max_epochs,
        callbacks=[stopper, checkpoint, recorder],
        logger=loggers,
        log_every_n_steps=1,
        gradient_clip_val=clip,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, rank_loader(batches, rank, world_size), val)
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
    local = habit_trainer(
        world_size,
        max_epochs=max_epochs,
        callbacks=[EarlyStopping(monitor="val_loss_local", patience=1), local_recorder],
    )
    local.fit(HabitModel(lr=lr), rank_loader(batches, rank, world_size), val)
    fit_result["local_stop"] = {"history": local_recorder.val_history, "global_step": local.global_step}

    rows = samples(predict_rows, PREDICT_SEED)
    pred_dir = out_dir / "predictions"
    pred_dir.mkdir(exist_ok=True)
    predictor = habit_trainer(world_size, callbacks=[_RowWriter(pred_dir)], use_distributed_sampler=True)
    predictor.predict(model, DataLoader(rows, batch_size=4, collate_fn=to_batch), return_predictions=False)
    result = {**fit_result, "validated_best": validated}
    if rank == 0:
        single = HabitModel.load_from_checkpoint(checkpoint.best_model_path)
        single.eval()
        with torch.no_grad():
            result["single_process_logits"] = single(to_batch(rows)).tolist()
    return result
