"""What one rank does in the pipelining tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_rec.checkpoint import is_checkpoint
from tests.helpers.checkpoint_scenarios import fixed_batch
from tests.helpers.models import RecModel
from tests.helpers.scenarios import make_loader, make_trainer


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
