"""Your own data: Parquet and CSV tables read through a declared :class:`~lightning_rec.data.schema.Schema`.

Example (YAML)::

    data:
      class_path: lightning_rec.data.TabularDataModule
      init_args:
        files: [data/clicks/*.parquet]                 # or train/val/test: one list of files or globs per split
        split: {random: {val: 0.1, test: 0.1, seed: 42}}
        schema:
          labels: [{column: clicked}]
          dense: [{column: price, transform: log1p}]
          sparse:
            - {column: user_id, ids: hash, num_embeddings: 1000000}
            - {column: item_id, ids: vocab}

Files: Parquet (``.parquet``/``.pq``, read with ``pyarrow``), CSV/TSV (``.csv``/``.tsv``/``.txt``, optionally
``.gz``; a header line names the columns, or ``csv_columns`` does). Splits: one list of files per split, or one list
and a rule: ``{random: {val, test, seed}}`` (the seeded two-stage holdout of
:class:`~lightning_rec.data.MovieLensDataModule`) or ``{timestamp: {column, val_from, test_from}}``.

The rows are read into columns (no Python per row) and batched by
:class:`~lightning_rec.data.base.DistributedBatchSampler`: every rank runs the same number of batches, every row is
used once per epoch. What the training split teaches (``vocab`` vocabularies, ``standardize`` statistics) is
computed once, kept in the DataModule's ``state_dict`` (so Lightning saves it inside every checkpoint and restores it
with ``ckpt_path``, and predictions map ids the same way) and, with ``state_dir``, written there as files.

Bad data is refused before training, naming the file, the row group (Parquet) or line (CSV), the column and the
value: a missing column, a column of the wrong type, a null id, NaN or inf in a dense column, a weight list whose
length differs from its id list. ``bad_rows: drop`` drops such rows instead (not missing or mistyped columns) and
counts them in ``dropped_rows``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from lightning_rec.config import SparseFeature
from lightning_rec.data._tabular_read import (
    Decoded,
    Mapper,
    Part,
    UnitReader,
    concat_jagged,
    decode,
    expand,
    read_table,
    rows_of,
    take,
    where,
)
from lightning_rec.data.base import RecDataModule, RecDataset
from lightning_rec.data.movielens import _holdout_split
from lightning_rec.data.schema import Schema, SparseColumn, Vocabulary
from lightning_rec.data.stream import TableStream, Unit, list_units, read_unit

__all__ = ["SplitRule", "TabularDataModule"]

_SPLITS = ("train", "val", "test")


@dataclass
class SplitRule:
    """How one set of files is split: ``random`` (``{val, test, seed}``) or ``timestamp`` (``{column, val_from,
    test_from}``: rows at or after ``val_from`` validate, at or after ``test_from`` test)."""

    random: dict[str, float] | None = None
    timestamp: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.random is None) == (self.timestamp is None):
            raise ValueError("TabularDataModule: split takes one rule: {random: {...}} or {timestamp: {...}}.")


def _random_split(n: int, val: float, test: float, seed: int) -> np.ndarray:
    """0 train, 1 val, 2 test per row: the two-stage seeded holdout of MovieLensDataModule (same rows)."""
    split = np.zeros(n, dtype=np.int8)
    rest, held_test = _holdout_split(n, test, seed + 1)
    train, held_val = _holdout_split(len(rest), val / (1.0 - test), seed)
    split[held_test.numpy()] = 2
    split[rest[held_val].numpy()] = 1
    return split


class TabularDataModule(RecDataModule):
    """Parquet/CSV files through a declared schema (see the module docstring).

    Args:
        schema: the columns (a :class:`~lightning_rec.data.schema.Schema` or its dict from YAML).
        files: files or globs holding every split, split by ``split``.
        train, val, test: files or globs per split (instead of ``files`` + ``split``); without ``test`` the
            validation split is tested.
        split: the rule that splits ``files`` (a :class:`SplitRule` or its dict).
        csv_columns: the column names of CSV files without a header line.
        csv_delimiter: the CSV field separator (default ``,``; ``\\t`` for ``.tsv``).
        bad_rows: ``"error"`` (default) or ``"drop"`` (counted in :attr:`dropped_rows`).
        state_dir: a directory to also write the vocabularies and statistics to (``vocab_<feature>.txt``,
            ``dense_stats.json``); they are always in the DataModule's ``state_dict``.
        batch_size, num_workers, seed: see :class:`~lightning_rec.data.base.RecDataModule`.

    Example::

        dm = TabularDataModule(schema={"labels": [{"column": "click"}], "sparse": [{"column": "user", "ids": "vocab"}]},
                               files=["clicks.parquet"], split={"random": {"val": 0.1, "test": 0.0, "seed": 0}})
        dm.sparse_features    # [SparseFeature(name='user', num_embeddings=..., ...)]
    """

    def __init__(
        self,
        schema: Schema | Mapping[str, Any],
        files: str | list[str] | None = None,
        train: str | list[str] | None = None,
        val: str | list[str] | None = None,
        test: str | list[str] | None = None,
        split: SplitRule | Mapping[str, Any] | None = None,
        csv_columns: list[str] | None = None,
        csv_delimiter: str | None = None,
        bad_rows: Literal["error", "drop"] = "error",
        state_dir: str | None = None,
        stream: bool = False,
        window: int = 8,
        chunk_bytes: int = 32 << 20,
        batch_size: int = 512,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.stream, self.window, self.chunk_bytes = stream, window, chunk_bytes
        if stream and files is not None:
            raise ValueError(
                "TabularDataModule(stream=True) reads one list of files per split: give train (and val/test) "
                "instead of files + split."
            )
        self.schema = schema if isinstance(schema, Schema) else Schema(**dict(schema))
        if (files is None) == (train is None):
            raise ValueError("TabularDataModule: give either `files` (with a `split` rule) or `train` (and val/test).")
        if files is not None and split is None:
            raise ValueError("TabularDataModule: `files` needs a `split` rule, e.g. {random: {val: 0.1, test: 0.1}}.")
        self.split_rule = split if split is None or isinstance(split, SplitRule) else SplitRule(**dict(split))
        self.sources = {"all": files} if files is not None else {"train": train, "val": val, "test": test}
        self.csv_columns, self.csv_delimiter = csv_columns, csv_delimiter
        self.bad_rows = bad_rows
        self.state_dir = state_dir
        self.dropped_rows = 0
        self.vocabularies: dict[str, Vocabulary] = {}
        self.dense_stats: dict[str, tuple[float, float]] = {}
        self._splits: dict[str, RecDataset] = {}
        self._decoded: dict[str, Decoded] | None = None
        self._unit_lists: dict[str, list[Unit]] = {}

    # ---- what the model needs --------------------------------------------------------------------------------
    @property
    def sparse_features(self) -> list[SparseFeature]:
        self._learn()
        return self.schema.sparse_features({table: len(v) for table, v in self.vocabularies.items()})

    @property
    def num_dense_features(self) -> int:
        return len(self.schema.dense)

    # ---- reading ----------------------------------------------------------------------------------------------
    def _columns(self) -> list[str]:
        extra = [self.split_rule.timestamp["column"]] if self.split_rule and self.split_rule.timestamp else []
        return list(dict.fromkeys(self.schema.columns + extra))

    def _read(self) -> dict[str, Decoded]:
        """Every split's rows, decoded and checked (ids not mapped yet)."""
        if self._decoded is not None:
            return self._decoded
        drop = self.bad_rows == "drop"
        stamp = self.split_rule.timestamp["column"] if self.split_rule and self.split_rule.timestamp else None
        out: dict[str, Decoded] = {}
        for name, patterns in self.sources.items():
            if patterns is None:
                continue
            parts = [
                decode(p, self.schema, drop, stamp)
                for f in expand(patterns, name)
                for p in read_table(f, self._columns(), self.csv_columns, self.csv_delimiter)
            ]
            out[name] = self._join(parts)
        if "all" in out:
            out = self._apply_rule(out.pop("all"))
        self._decoded = out
        return out

    def _join(self, parts: Sequence[Decoded]) -> Decoded:
        keep = np.concatenate([p.keep for p in parts])
        self.dropped_rows += int((~keep).sum())
        sparse = {}
        for c in self.schema.sparse:
            ids, lengths, weights = concat_jagged([p.sparse[c.feature] for p in parts])
            values_kept = rows_of(lengths, keep)
            sparse[c.feature] = (ids[values_kept], lengths[keep], None if weights is None else weights[values_kept])
        stamps = None if parts[0].timestamps is None else np.concatenate([p.timestamps for p in parts])[keep]
        return Decoded(
            np.concatenate([p.labels for p in parts])[keep],
            np.concatenate([p.dense for p in parts])[keep],
            sparse,
            stamps,
            np.ones(int(keep.sum()), dtype=bool),
        )

    def _apply_rule(self, data: Decoded) -> dict[str, Decoded]:
        rule = self.split_rule
        assert rule is not None
        n = len(data.labels)
        if rule.random is not None:
            r = dict(rule.random)
            which = _random_split(n, float(r.get("val", 0.1)), float(r.get("test", 0.0)), int(r.get("seed", 0)))
        else:
            t = dict(rule.timestamp or {})
            stamps = data.timestamps
            assert stamps is not None
            which = np.zeros(n, dtype=np.int8)
            which[stamps >= float(t["val_from"])] = 1
            if t.get("test_from") is not None:
                which[stamps >= float(t["test_from"])] = 2
        return {name: take(data, which == i) for i, name in enumerate(_SPLITS) if (which == i).any()}

    # ---- learning from the training split ----------------------------------------------------------------------
    def _learn(self) -> None:
        """Vocabularies (one per table: features sharing a table share its ids) and dense statistics, from files or
        the training split, unless already known."""
        needed: dict[str, list[SparseColumn]] = {}
        for c in self.schema.sparse:
            key = c.table or c.feature
            if c.ids == "vocab" and key not in self.vocabularies:
                needed.setdefault(key, []).append(c)
        for key, group in list(needed.items()):
            files = [c.vocab_file for c in group if c.vocab_file]
            if files:
                self.vocabularies[key] = Vocabulary.read(files[0])
                del needed[key]
        stats = [c for c in self.schema.dense if c.transform == "standardize" and c.column not in self.dense_stats]
        stats = [c for c in stats if c.mean is None or c.std is None]
        if not needed and not stats:
            return
        counts: dict[str, dict[str, int]] = {key: {} for key in needed}
        moments = np.zeros((len(stats), 3))  # rows, sum, sum of squares per standardized column
        for train in self._train_parts():
            for key, group in needed.items():
                raw = np.concatenate([train.sparse[c.feature][0].astype(str) for c in group])
                values, n = np.unique(raw, return_counts=True)
                seen = counts[key]
                for v, k in zip(values.tolist(), n.tolist()):
                    seen[v] = seen.get(v, 0) + k
            for i, d in enumerate(stats):
                column = train.dense[train.keep, self.schema.dense.index(d)]
                moments[i] += (len(column), column.sum(), np.square(column).sum())
        for key, group in needed.items():
            self.vocabularies[key] = Vocabulary.build(counts[key], max(c.min_count for c in group))
        for (n, total, squares), d in zip(moments, stats):
            mean = total / max(n, 1)
            self.dense_stats[d.column] = (float(mean), float(np.sqrt(max(squares / max(n, 1) - mean**2, 0.0))))
        self._write_state()

    def _write_state(self) -> None:
        if not self.state_dir:
            return
        import json

        os.makedirs(self.state_dir, exist_ok=True)
        for table, vocab in self.vocabularies.items():
            vocab.write(os.path.join(self.state_dir, f"vocab_{table}.txt"))
        with open(os.path.join(self.state_dir, "dense_stats.json"), "w") as f:
            json.dump({k: {"mean": m, "std": s} for k, (m, s) in self.dense_stats.items()}, f, indent=2)

    def state_dict(self) -> dict[str, Any]:
        """The vocabularies and dense statistics (Lightning saves them in every checkpoint)."""
        return {
            "vocabularies": {f: v.values for f, v in self.vocabularies.items()},
            "dense_stats": {k: list(v) for k, v in self.dense_stats.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, so ids map as when training.

        Lightning restores a checkpoint after ``setup()`` built the splits: the in-memory splits are built again (on
        their next use) only if the checkpoint's vocabularies or statistics differ from those they were built with.
        """
        before = self.state_dict()
        self.vocabularies = {f: Vocabulary(v) for f, v in state.get("vocabularies", {}).items()}
        self.dense_stats = {k: (float(v[0]), float(v[1])) for k, v in state.get("dense_stats", {}).items()}
        if self.state_dict() != before:
            self._splits = {}

    # ---- splits ---------------------------------------------------------------------------------------------
    def _train_parts(self) -> Iterator[Decoded]:
        """The training split's rows for learning vocabularies and statistics: whole (in memory), or (streaming) one
        unit at a time, never all at once; the streaming pass also checks every training row before training."""
        if not self.stream:
            yield self._read()["train"]
            return
        drop = self.bad_rows == "drop"
        for unit in self._units("train"):
            table = read_unit(unit, self._columns(), self.csv_columns, self.csv_delimiter)
            decoded = decode(Part(table, unit.file, where(unit), unit.first_line), self.schema, drop, None)
            if drop:
                self.dropped_rows += int((~decoded.keep).sum())
            yield take(decoded, decoded.keep)

    def _units(self, split: str) -> list[Unit]:
        if split not in self._unit_lists:
            patterns = self.sources.get(split)
            if patterns is None:
                raise ValueError(f"TabularDataModule: no files for the {split!r} split.")
            self._unit_lists[split] = list_units(expand(patterns, split), self.chunk_bytes, header=not self.csv_columns)
        return self._unit_lists[split]

    def setup(self, stage: str) -> None:
        if self._splits:
            return
        self._learn()
        if self.stream:
            return  # the loaders read the files
        self._build()

    def _build(self) -> None:
        """The in-memory splits, their ids mapped by the current vocabularies and statistics."""
        self._learn()
        decoded = self._read()
        if "train" not in decoded:
            raise ValueError("TabularDataModule: the training split has no rows.")
        mapper = self._mapper()
        self._splits = {name: mapper.dataset(d) for name, d in decoded.items()}
        if "test" not in self._splits and "val" in self._splits:
            self._splits["test"] = self._splits["val"]

    def _mapper(self) -> Mapper:
        return Mapper(self.schema, dict(self.vocabularies), dict(self.dense_stats))

    def split(self, name: str) -> RecDataset | TableStream:
        """In memory: the rows of split ``name`` (after :meth:`setup`); streaming: a :class:`TableStream` of this
        rank's batches of its files. ``predict`` runs over the validation rows (and, streaming, ``test`` too when
        there are no test files)."""
        if self.stream:
            return self._stream(name)
        name = "val" if name == "predict" else name
        if not self._splits:
            self._build()  # a checkpoint restored after setup() brought other vocabularies or statistics
        if name not in self._splits:
            raise ValueError(f"TabularDataModule: there is no {name!r} split (splits: {sorted(self._splits)}).")
        return self._splits[name]

    def _stream(self, name: str) -> TableStream:
        split = "val" if name == "predict" else name
        if split == "test" and self.sources.get("test") is None:
            split = "val"
        rank, world_size = self.rank_and_world_size
        reader = UnitReader(self._mapper(), self._columns(), self.csv_columns, self.csv_delimiter, self.bad_rows)
        return TableStream(
            self._units(split),
            reader,
            self.batch_size,
            rank=rank,
            world_size=world_size,
            shuffle=split == "train",
            seed=self.seed,
            window=self.window,
        )
