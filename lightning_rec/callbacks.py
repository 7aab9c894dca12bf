"""Callbacks: the throughput the CLI shows by default, and pretrained rows for a config."""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

import lightning.pytorch as pl

from lightning_rec.batch import Batch
from lightning_rec.pretrained import load_rows
from lightning_rec.tables import is_sharded

__all__ = ["PretrainedRows", "Throughput"]


def _batch_rows(batch: Any) -> Optional[int]:
    if isinstance(batch, Batch):
        return int(batch.labels.shape[0])
    labels = batch.get("labels", batch.get("label")) if isinstance(batch, dict) else None
    return int(labels.shape[0]) if labels is not None else None


class Throughput(pl.Callback):
    """Shows training throughput (samples/s over all ranks) on the progress bar and logs it.

    Measured over the current epoch from the end of its first batch (so start-up is excluded), counting
    this rank's rows times the world size (ranks step together, with batch sizes differing by at most one
    row). Logged as ``train/samples_per_s`` every ``log_every_n_steps``, like any metric.

    Args:
        name: the logged key.

    Example::

        trainer = L.Trainer(strategy="recshard", devices=2, callbacks=[Throughput()])
    """

    def __init__(self, name: str = "train/samples_per_s") -> None:
        self.name = name
        self._start: Optional[float] = None
        self._rows = 0

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._start, self._rows = None, 0

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        rows = _batch_rows(batch)
        if rows is None:
            return
        now = time.perf_counter()
        if self._start is None:
            self._start = now
            return
        self._rows += rows * trainer.world_size
        pl_module.log(self.name, self._rows / max(now - self._start, 1e-9), prog_bar=True, rank_zero_only=True)


class PretrainedRows(pl.Callback):
    """Start the named tables from files of rows (see :func:`lightning_rec.pretrained.load_rows`), from a config.

    The rows go into the unsharded tables in ``setup``, before the strategy shards them, so every plan starts from
    them; a checkpoint given to ``fit(ckpt_path=...)`` or ``validate``/``predict`` is loaded afterwards and wins.
    Once the module is sharded the callback has nothing left to do (a second ``fit`` keeps the trained rows).

    Args:
        rows: table name -> file (``.npy``, ``.safetensors``, a ``torch.save`` file, e.g. ``lightning-rec export``'s
            output).

    Example (YAML)::

        trainer:
          callbacks:
            - class_path: lightning_rec.callbacks.PretrainedRows
              init_args: {rows: {t_item_id: item_rows.npy}}
    """

    def __init__(self, rows: Dict[str, str]) -> None:
        self.rows = dict(rows)

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if not is_sharded(pl_module):
            load_rows(pl_module, self.rows)
