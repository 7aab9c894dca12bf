"""Callbacks: the throughput the CLI shows by default, pretrained rows for a config, predictions to files."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torchrec.datasets.utils import Batch

from lightning_rec._pretrained import load_rows
from lightning_rec._tables import is_sharded

__all__ = ["PredictionWriter", "PretrainedRows", "Throughput"]


def _batch_rows(batch: Any) -> int | None:
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
        self._start: float | None = None
        self._rows = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._rows = None, 0

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
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
    """Start the named tables from files of rows (see :func:`lightning_rec._pretrained.load_rows`), from a config.

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

    def __init__(self, rows: dict[str, str]) -> None:
        self.rows = dict(rows)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not is_sharded(pl_module):
            load_rows(pl_module, self.rows)


class PredictionWriter(BasePredictionWriter):
    """Writes what ``predict_step`` returned to ``output_dir/predictions.rank<R>.pt``, one file per rank: the
    batches' dicts (or tensors) concatenated along the batch dimension, in the order the rank predicted them, so
    that ``lightning-rec predict`` leaves its predictions on disk.

    Args:
        output_dir: where to write (created if need be).

    Example (shell)::

        lightning-rec predict --config my.yaml --ckpt_path last.ckpt --trainer.devices=1 \\
            --trainer.callbacks+=lightning_rec.callbacks.PredictionWriter --trainer.callbacks.output_dir=preds

    then ``torch.load("preds/predictions.rank0.pt")["probability"]``.
    """

    def __init__(self, output_dir: str) -> None:
        super().__init__(write_interval="epoch")
        self.output_dir = Path(output_dir)

    def write_on_epoch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any] | None,
    ) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        torch.save(_concatenated(list(predictions)), self.output_dir / f"predictions.rank{trainer.global_rank}.pt")


def _concatenated(batches: list[Any]) -> Any:
    if batches and isinstance(batches[0], list):  # several predict dataloaders: the first
        batches = batches[0]
    if not batches:
        return {}
    if isinstance(batches[0], dict):
        return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    return torch.cat(batches)
