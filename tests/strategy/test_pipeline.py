"""Pipelined input distribution (`RecShardStrategy(pipeline=True)`) inside Lightning's loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_rec.checkpoint import is_checkpoint
from tests.helpers.checkpoint_scenarios import fixed_batch
from tests.helpers.dist import run_ranks
from tests.helpers.models import RecModel
from tests.helpers.scenarios import make_loader, make_trainer

pytestmark = pytest.mark.dist


def test_pipelined_training_matches_the_plain_loop_on_two_processes(tmp_path):
    """Same per-step losses, validation, logging, checkpoints and predictions as without pipelining."""
    plain = run_ranks(fit, 2, tmp_path / "plain", pipeline=False)
    piped = run_ranks(fit, 2, tmp_path / "piped", pipeline=True)
    for a, b in zip(plain, piped):
        assert b["pipelined"] == "SparseDistPipeline"
        # training ran TorchRec's pipelined forward (inputs distributed ahead); evaluation the module's own
        assert b["forwards"] == {"train": ["PipelinedForward"], "val": ["method"]}
        assert a["forwards"] == {"train": ["method"], "val": ["method"]}
        assert len(a["losses"]) == 12 and b["closure_calls"] == a["closure_calls"] == 12
        assert b["losses"] == pytest.approx(a["losses"], abs=1e-5)
        assert b["global_step"] == a["global_step"] == 12
        # validation ran the evaluation forwards (not training steps), twice, on the same weights
        assert b["val_batches"] == a["val_batches"] == 4
        assert b["val_losses"] == pytest.approx(a["val_losses"], abs=1e-5)
        assert b["logged_train_loss"] == pytest.approx(a["logged_train_loss"], abs=1e-5)
        assert b["predictions"] == pytest.approx(a["predictions"], abs=1e-5)
        assert a["last_complete"] and b["last_complete"]


# ------------------------------------------------------------------------------------------------------------
# What each rank runs (run_ranks imports it from this module).
# ------------------------------------------------------------------------------------------------------------


class Observe(L.Callback):
    """Validation batches and losses, and which forward the sharded EBC ran in training vs validation."""

    def __init__(self) -> None:
        self.val_batches = 0
        self.val_losses = []
        self.forwards = {"train": set(), "val": set()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.forwards["train"].add(type(pl_module.ebc.forward).__name__)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.val_batches += 1
        self.val_losses.append(float(outputs))
        self.forwards["val"].add(type(pl_module.ebc.forward).__name__)


def fit(rank: int, world_size: int, out_dir: Path, pipeline: bool, steps: int = 6, epochs: int = 2) -> dict[str, Any]:
    """Fit with validation every epoch and checkpoints, then predict; report what the test compares."""
    L.seed_everything(0)
    model = RecModel()
    counter = Observe()
    ckpt = ModelCheckpoint(dirpath=out_dir / f"ckpt_{pipeline}", save_last=True)
    trainer = make_trainer(
        world_size, -1, {"pipeline": pipeline}, max_epochs=epochs, limit_val_batches=2, callbacks=[counter, ckpt]
    )
    trainer.fit(model, make_loader(rank, steps, 16, {}), make_loader(rank, 2, 16, {}, seed=300))
    logged_train_loss = float(trainer.callback_metrics["train_loss"])
    predictions = trainer.predict(model, DataLoader([fixed_batch()], batch_size=None))[0]
    return {
        "losses": model.losses,
        "closure_calls": model.closure_calls,
        "global_step": trainer.global_step,
        "val_batches": counter.val_batches,
        "val_losses": counter.val_losses,
        "logged_train_loss": logged_train_loss,
        "predictions": [float(x) for x in predictions],
        "last_complete": is_checkpoint(Path(ckpt.last_model_path)),
        "pipelined": type(trainer.strategy._sparse_dist).__name__ if pipeline else None,
        "forwards": {k: sorted(v) for k, v in counter.forwards.items()},
    }
