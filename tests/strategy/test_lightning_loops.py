"""Lightning's loops and optimizers around a sharded fit, on 2 real processes (gloo): ``val_check_interval``
mid-epoch with an exact resume from a mid-epoch checkpoint, manual optimization with two optimizers (``Adam`` for
the dense layers, ``RowWiseAdagrad`` for the tables) and an LR scheduler the FBGEMM kernels follow, each against a
plain-PyTorch reference on whole batches. The model and trainer are ``test_lightning_habits.py``'s.

The scenarios (what each rank runs) are at the end of this module.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torchrec.optim import RowWiseAdagrad

from tests.helpers.dist import run_ranks
from tests.helpers.models import assemble, local_weights
from tests.helpers.user_models import global_batches, rank_share, to_batch
from tests.strategy.test_lightning_habits import VAL_SEED, HabitModel, dense_params, habit_trainer, rank_loader

pytestmark = pytest.mark.dist


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


# ===============================================================================================================
# What each rank runs (run_ranks imports them from this module).
# ===============================================================================================================


def _local_tables(model: torch.nn.Module) -> dict[str, list[Any]]:
    """This rank's table shards: ``{name: [[offsets, rows], ...]}`` (JSON)."""
    return {
        n: [[o, t.tolist()] for o, t in shards] for n, shards in local_weights(model).items() if n.startswith("ebc.")
    }


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
# 1. val_check_interval mid-epoch and an exact resume from a mid-epoch checkpoint.
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
    val = rank_loader(global_batches(1, 16, seed=VAL_SEED), rank, world_size)
    ckpt_dir = out_dir / "mid"

    def run(model: HabitModel, ckpt_path: Path | None) -> L.Trainer:
        checkpoint = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, filename="{epoch}-{step}")
        trainer = habit_trainer(world_size, max_epochs=epochs, val_check_interval=every, callbacks=[checkpoint])
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
# 2. Manual optimization with two optimizers; an LR scheduler seen by the FBGEMM kernels.
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
    trainer = habit_trainer(world_size, max_epochs=1)  # manual optimization counts a global step per optimizer step
    trainer.fit(model, rank_loader(batches, rank, world_size))
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
        lambda m: [torch.optim.Adam(dense_params(m), lr=0.02), RowWiseAdagrad(m.ebc.parameters(), lr=0.1)],
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
