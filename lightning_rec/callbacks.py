"""Callbacks: the throughput the CLI shows by default, pretrained rows for a config, predictions to files (raw
tensors per rank: :class:`PredictionWriter`; one table of keys and scores: :class:`ScoreWriter`)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, RandomSampler
from torchrec.datasets.utils import Batch

from lightning_rec._pretrained import load_rows
from lightning_rec._tables import is_sharded
from lightning_rec.data.base import DistributedBatchSampler

__all__ = ["PredictionWriter", "PretrainedRows", "ScoreWriter", "Throughput"]


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

    then ``torch.load("preds/predictions.rank0.pt")["probability"]``. The rows carry no key: to join scores back to
    the rows they belong to, :class:`ScoreWriter` (``lightning-rec predict --output scores.parquet``).
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


_TABLE_SUFFIXES = (".parquet", ".pq", ".csv", ".tsv")


class ScoreWriter(pl.Callback):
    """Writes the scores of every row ``predict`` ran over to one Parquet or CSV file, one row per row scored, in
    the rows' order, each beside its keys: ``lightning-rec predict --output scores.parquet`` adds it.

    The keys are the DataModule's ``predict_keys()`` (:meth:`~lightning_rec.data.TabularDataModule.predict_keys`:
    the schema's ``keys`` columns, e.g. ``[user_id, item_id]``, or ``row``, the row's place in the files scored);
    for any other DataModule, ``row``: the row's index in the predict split. Each of ``predict_step``'s outputs is a
    column, of its own type (``probability``, ``label``, ...; a ``(B, D)`` output a list column, in CSV its values as
    ``"[x, y, ...]"``); ``label`` is left out when the DataModule's ``predict_labeled`` is false (files scored
    without a label column).

    On several ranks each rank writes its rows to ``<output>.parts/``; rank 0 puts them in order by row index (the
    rows each rank predicted, from its predict loader's sampler: the DataModules'
    :class:`~lightning_rec.data.base.DistributedBatchSampler`, or any batch sampler that does not shuffle), checks
    that every row is there once (a row predicted twice, as a padding sampler repeats rows, is kept once), writes
    ``output`` and removes the parts.

    Args:
        output: the file: ``.parquet``/``.pq``, or ``.csv``/``.tsv``.

    Raises:
        ValueError: another suffix.

    Example::

        trainer = L.Trainer(strategy="recshard", devices=2, callbacks=[ScoreWriter("scores.parquet")])
        trainer.predict(model, datamodule=dm, ckpt_path="last.ckpt", return_predictions=False)
        pyarrow.parquet.read_table("scores.parquet").column_names   # ['user_id', 'item_id', 'probability', 'label']
    """

    def __init__(self, output: str) -> None:
        if not str(output).endswith(_TABLE_SUFFIXES):
            raise ValueError(
                f"ScoreWriter: output {str(output)!r}: a .parquet (or .pq) file, or .csv/.tsv, was expected."
            )
        self.output = Path(output)
        self._columns: dict[str, list[np.ndarray]] = {}

    @property
    def parts(self) -> Path:
        """Where each rank leaves its rows for rank 0."""
        return self.output.with_name(self.output.name + ".parts")

    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._columns = {}

    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if dataloader_idx:
            return  # the first predict loader's rows only
        outputs = outputs if isinstance(outputs, dict) else {"prediction": outputs}
        for name, value in outputs.items():
            if isinstance(value, torch.Tensor) and value.dim() in (1, 2):
                value = value.detach().cpu()
                if value.dtype in (torch.float16, torch.bfloat16):  # numpy has no bfloat16
                    value = value.float()
                self._columns.setdefault(name, []).append(value.numpy())

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        columns = {name: np.concatenate(parts) for name, parts in self._columns.items()}
        indices = _sampled_rows(trainer)
        rows = {len(c) for c in columns.values()}
        if rows and rows != {len(indices)}:
            raise RuntimeError(
                f"ScoreWriter: rank {trainer.global_rank} predicted {sorted(rows)} rows but its loader gave "
                f"{len(indices)}: cannot tell which row each score belongs to."
            )
        if trainer.global_rank == 0:
            shutil.rmtree(self.parts, ignore_errors=True)  # an earlier run's
        trainer.strategy.barrier("ScoreWriter.clean")
        self.parts.mkdir(parents=True, exist_ok=True)
        np.savez(self.parts / f"rank{trainer.global_rank}.npz", __row__=indices, **columns)  # type: ignore[arg-type]
        trainer.strategy.barrier("ScoreWriter.parts")
        if trainer.global_rank == 0:
            self._merge(trainer)
        trainer.strategy.barrier("ScoreWriter.written")
        self._columns = {}

    def _merge(self, trainer: pl.Trainer) -> None:
        import pyarrow as pa

        loaded = [np.load(self.parts / f"rank{r}.npz") for r in range(trainer.world_size)]
        indices = np.concatenate([part["__row__"] for part in loaded])
        names = [n for n in loaded[0].files if n != "__row__"]
        keys = _predict_keys(trainer)
        n = keys.num_rows
        order = np.argsort(indices, kind="stable")
        first = np.ones(len(order), dtype=bool)  # a row predicted twice (a padding sampler repeats rows): once
        first[1:] = indices[order][1:] != indices[order][:-1]
        order = order[first]
        if len(order) != n or not np.array_equal(indices[order], np.arange(n)):
            missing = n - int(np.isin(np.arange(n), indices).sum())
            raise RuntimeError(
                f"ScoreWriter: the ranks predicted {len(order)} distinct rows of {n} ({missing} missing): the "
                "predict loader does not cover every row. HINT: the DataModule's own predict loader does."
            )
        table = keys
        for name in names:
            values = np.concatenate([part[name] for part in loaded])[order]
            if name in table.column_names:
                raise ValueError(f"ScoreWriter: predict_step's output {name!r} has the name of a key column.")
            if name == "label" and getattr(_datamodule(trainer), "predict_labeled", True) is False:
                continue  # files scored without labels
            if values.ndim == 1:
                column = pa.array(values)
            elif self.output.suffix in (".csv", ".tsv"):  # CSV has no lists: a (B, D) output as "[x, y, ...]"
                column = pa.array(["[" + ", ".join(map(repr, row)) + "]" for row in values.tolist()])
            else:
                column = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
            table = table.append_column(name, column)
        _write_table(table, self.output)
        shutil.rmtree(self.parts, ignore_errors=True)
        rank_zero_info(f"ScoreWriter: wrote {n} rows ({', '.join(table.column_names)}) to {self.output}.")


def _sampled_rows(trainer: pl.Trainer) -> np.ndarray:
    """The rows of the predict split this rank predicted, in order: those its loader's sampler gives again (the
    DataModules' :class:`~lightning_rec.data.base.DistributedBatchSampler`, or a DataLoader's batch sampler; neither
    shuffles an evaluation split, and a shuffling one is refused)."""
    loaders = trainer.predict_dataloaders
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    sampler: Any = None
    if isinstance(loader, DataLoader):
        sampler = loader.sampler if isinstance(loader.sampler, DistributedBatchSampler) else loader.batch_sampler
    shuffles = isinstance(loader, DataLoader) and isinstance(loader.sampler, RandomSampler)
    if sampler is None or shuffles or getattr(sampler, "shuffle", False):
        raise RuntimeError(
            f"ScoreWriter: the predict loader ({type(loader).__name__}) does not say which rows it gives, in an order "
            "it gives again: a DataLoader with an unshuffled sampler (e.g. the DataModules') is needed."
        )
    batches = [b[1] if isinstance(b, tuple) else b for b in sampler]  # (epoch, rows) for with_epoch
    return np.concatenate([np.asarray(b, dtype=np.int64) for b in batches]) if batches else np.zeros(0, np.int64)


def _predict_keys(trainer: pl.Trainer) -> Any:
    """The keys of the predict split's rows: the DataModule's ``predict_keys()``, else each row's index."""
    import pyarrow as pa

    keys = getattr(_datamodule(trainer), "predict_keys", None)
    if callable(keys):
        return keys()
    loaders = trainer.predict_dataloaders
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    return pa.table({"row": np.arange(len(getattr(loader, "dataset", ())))})


def _datamodule(trainer: pl.Trainer) -> Any:
    return getattr(trainer, "datamodule", None)  # a property mypy does not see on Lightning's Trainer


def _write_table(table: Any, path: Path) -> None:
    """``table`` to ``path`` (Parquet, or CSV/TSV by its suffix), whole or not at all."""
    import pyarrow.csv
    import pyarrow.parquet

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    if path.suffix in (".csv", ".tsv"):
        options = pyarrow.csv.WriteOptions(delimiter="\t" if path.suffix == ".tsv" else ",")
        pyarrow.csv.write_csv(table, partial, write_options=options)
    else:
        pyarrow.parquet.write_table(table, partial)
    os.replace(partial, path)
