"""Lightning features that cannot work with fused (in-backward) tables are refused up front, naming the feature
and a HINT, before anything is sharded or updated (SWA, EMA, gradient accumulation, pruning, frozen tables, a
backward pass without an optimizer step, ``toggle_optimizer``); and the features that do work with them (tables
fixed by a zero learning rate, anomaly detection, value clipping, ReduceLROnPlateau, the learning-rate finder). One
process (the checks are the same on every rank). The model and trainer are ``test_lightning_habits.py``'s.

The scenario (what the rank runs) is at the end of this module.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_rec._compat import ShardedTensor
from tests.helpers.dist import run_ranks
from tests.helpers.user_models import global_batches
from tests.strategy.test_lightning_habits import VAL_SEED, HabitModel, dense_params, habit_trainer, rank_loader

pytestmark = pytest.mark.dist


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


# ---------------------------------------------------------------------------------------------------------------
# Other Lightning features: refused before anything changes, or working with fused tables.
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
        return torch.optim.Adagrad(dense_params(self), lr=self.hparams.lr)


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
        self.dense_at_train_start = [p.detach().clone() for p in dense_params(pl_module)]


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

    train = rank_loader(global_batches(4, 16), rank, world_size)
    val = rank_loader(global_batches(1, 16, seed=VAL_SEED), rank, world_size)

    def case(model: HabitModel, epochs: int | None = None, **trainer_kwargs: Any) -> dict[str, Any]:
        L.seed_everything(0)
        snapshots = _Snapshots()
        trainer_kwargs["callbacks"] = [snapshots, *trainer_kwargs.get("callbacks", [])]
        trainer = habit_trainer(
            world_size, **({"max_epochs": epochs} if epochs else {"max_steps": 4}), **trainer_kwargs
        )
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
            and not all(torch.equal(a, b) for a, b in zip(snapshots.dense_at_train_start, dense_params(model))),
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
