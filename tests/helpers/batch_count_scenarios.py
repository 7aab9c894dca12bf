"""Ranks of tests/strategy/test_batch_counts.py: training loaders that give the ranks different numbers of batches."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

import lightning_rec
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.models import RecModel, make_batches


class RankShard(IterableDataset):
    """A user's own IterableDataset sharded by rank, without a length: ``counts[rank]`` batches an epoch."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)


def uneven(rank: int, world_size: int, out_dir: Path, counts: list[int], sized: bool, epochs: int = 2) -> dict:
    """Fit ``epochs`` epochs with ``counts[rank]`` batches on this rank (a sized DataLoader or a bare iterable);
    report the error each rank stops with, the batches it trained and how long it took."""
    return _fit(rank, world_size, counts, sized, epochs)


def equal_then_sized(rank: int, world_size: int, out_dir: Path) -> dict:
    """Two fits in one job: equal bare iterables (4 batches, 3 epochs), then sized loaders of 5 and 4 batches."""
    return {"equal": _fit(rank, world_size, [4, 4], False, 3), "sized": _fit(rank, world_size, [5, 4], True, 2)}


def _fit(rank: int, world_size: int, counts: list[int], sized: bool, epochs: int) -> dict:
    batches = make_batches(counts[rank], 16, seed=100 + rank)
    data: Any = DataLoader(batches, batch_size=None) if sized else DataLoader(RankShard(batches), batch_size=None)
    model = RecModel()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=lightning_rec.RecShardStrategy(timeout=60),
        max_epochs=epochs,
        **QUIET_TRAINER,
    )
    start = time.monotonic()
    try:
        trainer.fit(model, data)
        error = None
    except Exception as e:  # noqa: BLE001 - the test inspects it
        error = f"{type(e).__name__}: {e}" + "".join(f"\n{n}" for n in getattr(e, "__notes__", []))
    return {"error": error, "batches": len(model.losses), "seconds": time.monotonic() - start}
