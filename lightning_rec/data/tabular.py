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

import glob
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from lightning_rec.config import SparseFeature
from lightning_rec.data.base import Column, Jagged, RecDataModule, RecDataset
from lightning_rec.data.schema import DataError, DenseColumn, Schema, SparseColumn, Vocabulary, hash_arrow
from lightning_rec.data.stream import StreamLoader, TableStream, Unit, list_units, read_unit

__all__ = ["TabularDataModule", "read_table"]

SPLITS = ("train", "val", "test")
_PARQUET = (".parquet", ".pq")
_TABLE_SUFFIXES = _PARQUET + (".csv", ".tsv", ".txt", ".csv.gz", ".tsv.gz", ".txt.gz")


def _pa() -> Any:
    try:
        import pyarrow  # noqa: F401
        import pyarrow.compute  # noqa: F401
        import pyarrow.csv  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as err:  # pragma: no cover - pyarrow is a dependency
        raise ImportError("TabularDataModule reads files with pyarrow: `pip install pyarrow`.") from err
    return pyarrow


def expand(patterns: str | Sequence[str], what: str) -> list[str]:
    """The table files ``patterns`` (paths, globs or directories) name, in sorted order per pattern.

    Raises:
        FileNotFoundError: naming a pattern that matches nothing.
    """
    files: list[str] = []
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        pattern = os.path.expanduser(str(pattern))
        if os.path.isdir(pattern):  # a directory: its tables
            pattern = os.path.join(pattern, "*")
        found = sorted(f for f in glob.glob(pattern) if os.path.isfile(f) and f.endswith(_TABLE_SUFFIXES))
        if not found:
            raise FileNotFoundError(f"TabularDataModule: {what}: {pattern!r} matches no file.")
        files.extend(found)
    return files


@dataclass
class _Part:
    """Columns of some rows of one file, with where they came from (for messages)."""

    table: Any  # pyarrow.Table
    file: str
    where: str  # "row group 3" or "lines 2-1001"
    first_line: int | None  # CSV: the line of the first row (1-based), for messages


def read_table(
    path: str, columns: Sequence[str], csv_columns: Sequence[str] | None = None, delimiter: str | None = None
) -> list[_Part]:
    """The ``columns`` of file ``path``: Parquet one part per row group, CSV one part.

    Raises:
        DataError: naming the file and the columns it lacks.
    """
    pa = _pa()
    if path.endswith(_PARQUET):
        pf = pa.parquet.ParquetFile(path)
        have = set(pf.schema_arrow.names)
        missing = [c for c in columns if c not in have]
        if missing:
            raise DataError(f"{path}: no column {', '.join(map(repr, missing))} (it has {sorted(have)}).")
        return [
            _Part(pf.read_row_group(g, columns=list(columns)), path, f"row group {g}", None)
            for g in range(pf.num_row_groups)
        ]
    tsv = any(path.endswith(s) for s in (".tsv", ".tsv.gz"))
    read = pa.csv.ReadOptions(column_names=list(csv_columns) if csv_columns else None)
    parse = pa.csv.ParseOptions(delimiter=delimiter or ("\t" if tsv else ","))
    try:
        table = pa.csv.read_csv(path, read_options=read, parse_options=parse)
    except pa.ArrowInvalid as err:
        raise DataError(f"{path}: not a readable CSV file: {err}") from None
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise DataError(f"{path}: no column {', '.join(map(repr, missing))} (it has {table.column_names}).")
    return [_Part(table.select(list(columns)), path, "", 1 if csv_columns else 2)]


def _at(part: _Part, row: int) -> str:
    if part.first_line is not None:
        return f"{part.file}, line {part.first_line + row}"
    return f"{part.file}, {part.where}, row {row}"


class _Bad:
    """Rows found bad while decoding a part: an error (``bad_rows: error``) or a mask (``drop``)."""

    def __init__(self, part: _Part, drop: bool) -> None:
        self.part, self.drop = part, drop
        self.mask = np.zeros(part.table.num_rows, dtype=bool)

    def found(self, rows: np.ndarray, column: str, problem: str, values: Sequence[Any]) -> None:
        if not len(rows):
            return
        if not self.drop:
            raise DataError(
                f"{_at(self.part, int(rows[0]))}: column {column!r}: {problem} (value {values[0]!r}"
                f"{f'; {len(rows)} such rows in this part' if len(rows) > 1 else ''}). HINT: fix the data, or set "
                "`bad_rows: drop` to drop such rows (they are counted)."
            )
        self.mask[rows] = True


def _numbers(part: _Part, column: str, bad: _Bad, kind: str) -> np.ndarray:
    pa = _pa()
    col = part.table.column(column)
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type)):
        raise DataError(f"{part.file}: column {column!r} is {col.type}, a number was expected ({kind}).")
    values = col.to_numpy(zero_copy_only=False).astype(np.float64)  # nulls become NaN
    nulls = np.flatnonzero(~np.isfinite(values))
    bad.found(nulls, column, "null, NaN or inf", [col[int(i)].as_py() for i in nulls[:1]])
    return np.where(np.isfinite(values), values, 0.0)


def _ids(values: Any, column: str, kind: str, file: str, hash_rows: int | None = None) -> np.ndarray:
    """A pyarrow array of ids (integers or text) as numpy for the mapping; with ``hash_rows``, already hashed into
    that many rows (from the array's buffers: no Python object per value)."""
    pa = _pa()
    if hash_rows is not None and (
        pa.types.is_integer(values.type) or pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
    ):
        return hash_arrow(values, hash_rows)
    if pa.types.is_integer(values.type):
        return values.to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return values.to_numpy(zero_copy_only=False).astype(str)
    raise DataError(f"{file}: column {column!r} holds {values.type}, integer or text ids were expected ({kind}).")


def _decode_sparse(part: _Part, spec: SparseColumn, bad: _Bad) -> tuple[Any, np.ndarray, np.ndarray | None]:
    """``(ids, lengths, weights)`` of one sparse column: ids still raw (numpy), per-row lengths, flat weights."""
    pa = _pa()
    col = part.table.column(spec.column).combine_chunks()
    n = len(col)
    if not spec.list:
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            raise DataError(f"{part.file}: column {spec.column!r} is {col.type}; declare it `list: true`.")
        nulls = np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))
        bad.found(nulls, spec.column, "null id", [None] * len(nulls))
        filled = col.fill_null(0) if pa.types.is_integer(col.type) else col.fill_null("")
        ids = _ids(filled, spec.column, "ids", part.file, _hashed(spec))
        return ids, np.ones(n, dtype=np.int64), None
    csv = part.first_line is not None
    if csv and (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):  # delimited text
        col = pa.compute.split_pattern(col.fill_null(""), spec.delimiter)
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise DataError(
            f"{part.file}: column {spec.column!r} is {col.type}, a list was declared (`list: true`): a row holds "
            "one value where a list was expected."
        )
    null_rows = np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))
    bad.found(null_rows, spec.column, "null list", [None] * len(null_rows))
    col = col.fill_null(pa.scalar([], type=col.type))
    lengths = pa.compute.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = col.flatten()
    if pa.types.is_string(flat.type) and csv:  # "a||b" or "" give empty values
        empty = pa.compute.equal(flat, "").to_numpy(zero_copy_only=False)
        if empty.any():
            row_of = np.repeat(np.arange(n), lengths)
            keep = ~empty
            lengths = np.bincount(row_of[keep], minlength=n).astype(np.int64)
            flat = flat.filter(pa.array(keep))
    value_nulls = flat.is_null().to_numpy(zero_copy_only=False)
    if value_nulls.any():
        rows = np.unique(np.repeat(np.arange(n), lengths)[value_nulls])
        bad.found(rows, spec.column, "null id in a list", [None] * len(rows))
        flat = flat.fill_null(0 if pa.types.is_integer(flat.type) else "")
    ids = _ids(flat, spec.column, "list ids", part.file, _hashed(spec))
    weights = None
    if spec.weights:
        wcol = part.table.column(spec.weights).combine_chunks()
        if csv and pa.types.is_string(wcol.type):
            wcol = pa.compute.split_pattern(wcol.fill_null(""), spec.delimiter)
        if not (pa.types.is_list(wcol.type) or pa.types.is_large_list(wcol.type)):
            raise DataError(f"{part.file}: column {spec.weights!r} is {wcol.type}, a list of weights was expected.")
        wlen = pa.compute.list_value_length(wcol.fill_null(pa.scalar([], type=wcol.type)))
        wlen = wlen.to_numpy(zero_copy_only=False).astype(np.int64)
        rows = np.flatnonzero(wlen != lengths)
        bad.found(
            rows,
            spec.weights,
            f"weight list length differs from {spec.column!r}'s",
            [f"{int(wlen[r])} weights for {int(lengths[r])} ids" for r in rows[:1]],
        )
        wflat = wcol.flatten()
        if pa.types.is_string(wflat.type):
            wflat = pa.compute.cast(wflat, pa.float64())
        weights = wflat.to_numpy(zero_copy_only=False).astype(np.float32)
        if len(rows):  # dropped rows: keep weights aligned with the ids
            weights = _per_row_take(weights, wlen, lengths)
    return ids, lengths, weights


def _hashed(spec: SparseColumn) -> int | None:
    """The rows ``hash`` ids go to (they are hashed as they are decoded), else ``None``."""
    if spec.ids != "hash":
        return None
    assert spec.num_embeddings is not None  # SparseColumn requires it of hash ids
    return int(spec.num_embeddings)


def _per_row_take(values: np.ndarray, have: np.ndarray, want: np.ndarray) -> np.ndarray:
    """The first ``min(have, want)`` values of each row, padded with 1.0 to ``want`` (rows that will be dropped)."""
    out = []
    start = 0
    for h, w in zip(have.tolist(), want.tolist()):
        row = values[start : start + min(h, w)]
        out.append(np.concatenate([row, np.ones(w - len(row), dtype=np.float32)]))
        start += h
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


@dataclass
class _Decoded:
    """One part's rows as columns, ids not yet mapped."""

    labels: np.ndarray  # (N, L) float
    dense: np.ndarray  # (N, D) float, not transformed
    sparse: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]  # feature -> (raw ids, lengths, weights)
    timestamps: np.ndarray | None
    keep: np.ndarray  # rows that are good


def _decode(part: _Part, schema: Schema, drop: bool, timestamp: str | None) -> _Decoded:
    bad = _Bad(part, drop)
    labels = np.stack([c.apply(_numbers(part, c.column, bad, "label")) for c in schema.labels], axis=1)
    dense = (
        np.stack([_numbers(part, c.column, bad, "dense") for c in schema.dense], axis=1)
        if schema.dense
        else np.zeros((part.table.num_rows, 0))
    )
    sparse = {c.feature: _decode_sparse(part, c, bad) for c in schema.sparse}
    stamps = _numbers(part, timestamp, bad, "timestamp") if timestamp else None
    return _Decoded(labels, dense, sparse, stamps, ~bad.mask)


def _concat_jagged(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None]]) -> tuple[Any, ...]:
    ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    lengths = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    weights = None if not parts or parts[0][2] is None else np.concatenate([p[2] for p in parts])
    return ids, lengths, weights


def _rows_of(lengths: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Mask of the values whose row is kept."""
    return np.repeat(keep, lengths)


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
    from lightning_rec.data.movielens import holdout_split

    split = np.zeros(n, dtype=np.int8)
    rest, held_test = holdout_split(n, test, seed + 1)
    train, held_val = holdout_split(len(rest), val / (1.0 - test), seed)
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
        self._decoded: dict[str, _Decoded] | None = None
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

    def _read(self) -> dict[str, _Decoded]:
        """Every split's rows, decoded and checked (ids not mapped yet)."""
        if self._decoded is not None:
            return self._decoded
        drop = self.bad_rows == "drop"
        stamp = self.split_rule.timestamp["column"] if self.split_rule and self.split_rule.timestamp else None
        out: dict[str, _Decoded] = {}
        for name, patterns in self.sources.items():
            if patterns is None:
                continue
            parts = [
                _decode(p, self.schema, drop, stamp)
                for f in expand(patterns, name)
                for p in read_table(f, self._columns(), self.csv_columns, self.csv_delimiter)
            ]
            out[name] = self._join(parts)
        if "all" in out:
            out = self._apply_rule(out.pop("all"))
        self._decoded = out
        return out

    def _join(self, parts: Sequence[_Decoded]) -> _Decoded:
        keep = np.concatenate([p.keep for p in parts])
        self.dropped_rows += int((~keep).sum())
        sparse = {}
        for c in self.schema.sparse:
            ids, lengths, weights = _concat_jagged([p.sparse[c.feature] for p in parts])
            values_kept = _rows_of(lengths, keep)
            sparse[c.feature] = (ids[values_kept], lengths[keep], None if weights is None else weights[values_kept])
        stamps = None if parts[0].timestamps is None else np.concatenate([p.timestamps for p in parts])[keep]
        return _Decoded(
            np.concatenate([p.labels for p in parts])[keep],
            np.concatenate([p.dense for p in parts])[keep],
            sparse,
            stamps,
            np.ones(int(keep.sum()), dtype=bool),
        )

    def _apply_rule(self, data: _Decoded) -> dict[str, _Decoded]:
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
        return {name: _take(data, which == i) for i, name in enumerate(SPLITS) if (which == i).any()}

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
        """Restore what :meth:`state_dict` saved (before the splits are built, so ids map as when training)."""
        self.vocabularies = {f: Vocabulary(v) for f, v in state.get("vocabularies", {}).items()}
        self.dense_stats = {k: (float(v[0]), float(v[1])) for k, v in state.get("dense_stats", {}).items()}
        self._splits = {}

    # ---- splits ---------------------------------------------------------------------------------------------
    def _train_parts(self) -> Iterator[_Decoded]:
        """The training split's rows for learning vocabularies and statistics: whole (in memory), or (streaming) one
        unit at a time, never all at once; the streaming pass also checks every training row before training."""
        if not self.stream:
            yield self._read()["train"]
            return
        drop = self.bad_rows == "drop"
        for unit in self._units("train"):
            table = read_unit(unit, self._columns(), self.csv_columns, self.csv_delimiter)
            decoded = _decode(_Part(table, unit.file, _where(unit), unit.first_line), self.schema, drop, None)
            if drop:
                self.dropped_rows += int((~decoded.keep).sum())
            yield _take(decoded, decoded.keep)

    def _units(self, split: str) -> list[Unit]:
        if split not in self._unit_lists:
            patterns = self.sources.get(split)
            if patterns is None:
                raise ValueError(f"TabularDataModule: no files for the {split!r} split.")
            self._unit_lists[split] = list_units(expand(patterns, split), self.chunk_bytes, header=not self.csv_columns)
        return self._unit_lists[split]

    def dataloader(self, name: str) -> Any:
        """In memory: batches of the split's rows (:meth:`loader`); streaming: a :class:`StreamLoader`."""
        if not self.stream:
            return super().dataloader(name)
        split = "val" if name == "predict" else name
        if split == "test" and self.sources.get("test") is None:
            split = "val"
        rank, world_size = self.rank_and_world_size
        reader = _UnitReader(self._mapper(), self._columns(), self.csv_columns, self.csv_delimiter, self.bad_rows)
        stream = TableStream(
            self._units(split),
            reader,
            self.batch_size,
            rank=rank,
            world_size=world_size,
            shuffle=split == "train",
            seed=self.seed,
            window=self.window,
        )
        return StreamLoader(stream, num_workers=self.num_workers, pin_memory=self.pin_memory)

    def setup(self, stage: str) -> None:
        if self._splits:
            return
        self._learn()
        if self.stream:
            return  # the loaders read the files
        decoded = self._read()
        if "train" not in decoded:
            raise ValueError("TabularDataModule: the training split has no rows.")
        mapper = self._mapper()
        self._splits = {name: mapper.dataset(d) for name, d in decoded.items()}
        if "test" not in self._splits and "val" in self._splits:
            self._splits["test"] = self._splits["val"]

    def _mapper(self) -> _Mapper:
        return _Mapper(self.schema, dict(self.vocabularies), dict(self.dense_stats))

    def split(self, name: str) -> RecDataset:
        """The rows of split ``name`` (after :meth:`setup`); ``predict`` runs over the validation rows."""
        name = "val" if name == "predict" else name
        if name not in self._splits:
            raise ValueError(f"TabularDataModule: there is no {name!r} split (splits: {sorted(self._splits)}).")
        return self._splits[name]


def _take(d: _Decoded, mask: np.ndarray) -> _Decoded:
    sparse = {}
    for feature, (ids, lengths, weights) in d.sparse.items():
        values = _rows_of(lengths, mask)
        sparse[feature] = (ids[values], lengths[mask], None if weights is None else weights[values])
    stamps = None if d.timestamps is None else d.timestamps[mask]
    return _Decoded(d.labels[mask], d.dense[mask], sparse, stamps, np.ones(int(mask.sum()), dtype=bool))


class _Mapper:
    """Decoded columns to a :class:`~lightning_rec.data.base.RecDataset`: ids mapped, dense transformed. Holds only
    the schema and what the training split taught, so DataLoader workers get a small copy."""

    def __init__(
        self, schema: Schema, vocabularies: dict[str, Vocabulary], dense_stats: dict[str, tuple[float, float]]
    ):
        self.schema, self.vocabularies, self.dense_stats = schema, vocabularies, dense_stats

    def dataset(self, d: _Decoded) -> RecDataset:
        sparse: dict[str, Column] = {}
        weights: dict[str, Jagged] = {}
        for c in self.schema.sparse:
            ids, lengths, w = d.sparse[c.feature]
            rows = self._map(c, ids)
            if c.list:
                offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
                sparse[c.feature] = Jagged(torch.from_numpy(rows), offsets)
                if w is not None:
                    weights[c.feature] = Jagged(torch.from_numpy(w), offsets)
            else:
                sparse[c.feature] = torch.from_numpy(rows)
        dense = (
            np.stack([self._dense(c).apply(d.dense[:, i]) for i, c in enumerate(self.schema.dense)], axis=1)
            if self.schema.dense
            else np.zeros((len(d.labels), 0), dtype=np.float32)
        )
        labels = d.labels[:, 0] if d.labels.shape[1] == 1 else d.labels
        return RecDataset(
            torch.from_numpy(np.ascontiguousarray(dense)), torch.from_numpy(labels.astype(np.float32)), sparse, weights
        )

    def _dense(self, c: DenseColumn) -> DenseColumn:
        if c.transform != "standardize" or (c.mean is not None and c.std is not None):
            return c
        mean, std = self.dense_stats[c.column]
        return DenseColumn(c.column, c.transform, mean, std)

    def _map(self, c: SparseColumn, ids: np.ndarray) -> np.ndarray:
        if c.ids == "hash":
            return ids  # hashed as decoded (_decode_sparse)
        if c.ids == "vocab":
            return self.vocabularies[c.table or c.feature].rows(ids)
        return ids.astype(np.int64)


def _where(unit: Unit) -> str:
    return f"row group {unit.row_group}" if unit.row_group is not None else ""


class _UnitReader:
    """Rows ``[a, b)`` of a unit as a dataset (what :class:`~lightning_rec.data.stream.TableStream` reads), keeping
    the last unit read: consecutive windows of a worker usually fall in the same unit."""

    def __init__(self, mapper: _Mapper, columns: list[str], csv_columns: Any, delimiter: Any, bad_rows: str) -> None:
        self.mapper, self.columns, self.csv_columns, self.delimiter = mapper, columns, csv_columns, delimiter
        self.drop = bad_rows == "drop"
        self._last: tuple[Unit, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_last": None}

    def __call__(self, unit: Unit, a: int, b: int) -> RecDataset:
        if self._last is None or self._last[0] != unit:
            self._last = (unit, read_unit(unit, self.columns, self.csv_columns, self.delimiter))
        table = self._last[1].slice(a, b - a)
        first = None if unit.first_line is None else unit.first_line + a
        part = _Part(table, unit.file, f"{_where(unit)} from row {a}" if unit.row_group is not None else "", first)
        return self.mapper.dataset(_decode(part, self.mapper.schema, self.drop, None))
