"""Per-rank scenarios of the model-zoo harness (:mod:`tests.helpers.zoo`), run through ``run_ranks``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_rec import RecShardStrategy
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.models import sharded_forwards
from tests.helpers.zoo import ZooCase, flatten, load_case, reference, seeded_module


class _Losses(L.Callback):
    """Each step's loss, as ``training_step`` returned it (automatic or manual optimization), and the forward every
    sharded embedding module ran in it (:func:`~tests.helpers.models.sharded_forwards`)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.forwards: list[dict[str, str]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        self.forwards.append(sharded_forwards(pl_module))


def _trainer(case: ZooCase, world_size: int, pipeline: bool = False) -> L.Trainer:
    return L.Trainer(
        strategy=RecShardStrategy(constraints=case.constraints.get(world_size), pipeline=pipeline),
        accelerator="cpu",
        devices=world_size,
        max_steps=case.steps,
        limit_val_batches=0,
        **QUIET_TRAINER,
    )


def _loader(batches: list[Any]) -> DataLoader:
    return DataLoader(batches, batch_size=None, collate_fn=lambda b: b)


def _predict(
    trainer: L.Trainer, module: L.LightningModule, case: ZooCase, rank: int, world_size: int, ckpt: str | None = None
) -> list[list[float]]:
    shares = _loader([case.share(case.heldout(), rank, world_size)])
    return torch.cat([flatten(p) for p in trainer.predict(module, shares, ckpt_path=ckpt)]).tolist()


def _fit(case: ZooCase, rank: int, world_size: int, pipeline: bool) -> tuple:
    module = seeded_module(case)
    losses = _Losses()
    trainer = _trainer(case, world_size, pipeline)
    trainer.callbacks.append(losses)
    trainer.fit(module, _loader([case.share(b, rank, world_size) for b in case.batches(case.steps)]))
    return trainer, module, losses


def fit(
    rank: int, world_size: int, out_dir: Path, case: str, save: str | None = None, predict_ckpt: str | None = None
) -> dict[str, Any]:
    """Fit from the seeded start (rank 0 also runs the plain-PyTorch reference first), fit again pipelined, save,
    predict the held-out share; with ``predict_ckpt``, also predict from that checkpoint with a fresh module. Both
    fits report each step's loss and the forward each sharded embedding module ran in it."""
    zoo = load_case(case)
    result: dict[str, Any] = {}
    if rank == 0:
        result["reference"] = reference(zoo, seeded_module(zoo))
    trainer, module, plain = _fit(zoo, rank, world_size, pipeline=False)
    result["losses"], result["forwards"] = plain.losses, plain.forwards
    result["predictions"] = _predict(trainer, module, zoo, rank, world_size)
    if save:
        trainer.save_checkpoint(out_dir / save)
    _, _, piped = _fit(zoo, rank, world_size, pipeline=True)
    result["pipelined_losses"], result["pipelined_forwards"] = piped.losses, piped.forwards
    if predict_ckpt:
        result["from_ckpt"] = _from_ckpt(zoo, rank, world_size, predict_ckpt)
    return result


def _from_ckpt(zoo: ZooCase, rank: int, world_size: int, ckpt: str) -> list[list[float]]:
    L.seed_everything(1, verbose=False)  # other dense weights: they must come from the checkpoint
    module = zoo.build()
    return _predict(_trainer(zoo, world_size), module, zoo, rank, world_size, ckpt=ckpt)


def predict(rank: int, world_size: int, out_dir: Path, case: str, ckpt: str) -> dict[str, Any]:
    """A fresh module predicts the held-out share from ``ckpt``."""
    return {"from_ckpt": _from_ckpt(load_case(case), rank, world_size, ckpt)}
