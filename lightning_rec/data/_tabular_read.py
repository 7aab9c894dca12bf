"""Reading the tables of :class:`~lightning_rec.data.tabular.TabularDataModule`: Parquet and CSV files to checked
columns (:func:`read_table`, :func:`decode`: bad data refused naming file, row group or line, column and value), and
decoded columns to a :class:`~lightning_rec.data.base.RecDataset` (:class:`Mapper`: ids mapped, dense transformed).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_rec.data import _filesystems
from lightning_rec.data.base import Jagged, RecDataset, _Column
from lightning_rec.data.schema import (
    DataError,
    DenseColumn,
    Schema,
    SparseColumn,
    Vocabulary,
    hash_arrow,
    integer_text,
)
from lightning_rec.data.stream import Unit, read_unit

_PARQUET = (".parquet", ".pq")
_TABLE_SUFFIXES = _PARQUET + (".csv", ".tsv", ".txt", ".csv.gz", ".tsv.gz", ".txt.gz")
_KINDS = ", ".join(_TABLE_SUFFIXES)


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
    """The table files ``patterns`` name, in sorted order per pattern: paths, globs or directories on this machine,
    ``file://`` URLs of them, or object-storage URLs of objects, prefixes or globs (``s3://``, ``gs://``, ``az://``:
    :mod:`lightning_rec.data._filesystems`).

    Raises:
        FileNotFoundError: naming a pattern that matches no table file (a missing path, an empty glob or directory,
            a file of another kind, no such bucket), or a URL of a scheme not read (``https://``, ...), naming the
            schemes read.
        PermissionError: an object-storage URL without credentials or with access denied, naming it.
    """
    files: list[str] = []
    for given in [patterns] if isinstance(patterns, str) else patterns:
        if _filesystems.is_url(str(given)):
            files.extend(_filesystems.expand_url(str(given), what, _TABLE_SUFFIXES))
            continue
        pattern = _local(str(given), what)
        folder = os.path.isdir(pattern)
        if folder:  # a directory: its tables
            pattern = os.path.join(pattern, "*")
        matched = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
        found = [f for f in matched if f.endswith(_TABLE_SUFFIXES)]
        if not found:
            why = _no_table(pattern, matched) if not folder else f"is a folder with no table file ({_KINDS})."
            raise FileNotFoundError(f"TabularDataModule: {what}: {given!r} {why}")
        files.extend(found)
    return files


def _local(pattern: str, what: str) -> str:
    """A path on this machine: ``~`` expanded, a ``file://`` URL's path; a URL of a scheme not read refused by
    name."""
    scheme, sep, rest = pattern.partition("://")
    if sep and scheme.isidentifier() and len(scheme) > 1:  # "C://..." is a Windows drive, not a scheme
        if scheme.lower() != "file":
            read = ", ".join(f"{s}://" for s in _filesystems.SCHEMES)
            raise FileNotFoundError(
                f"TabularDataModule: {what}: {pattern!r}: {scheme}:// URLs are not read; a path, a glob, a directory, "
                f"a file:// URL or object storage ({read}) is."
            )
        pattern = rest if rest.startswith("/") else "/" + rest.partition("/")[2]  # file:///p or file://host/p
    return os.path.expanduser(pattern)


def _no_table(pattern: str, matched: Sequence[str]) -> str:
    """Why a pattern gave no table file, for :func:`expand`'s message."""
    if matched:
        return f"matches {len(matched)} file(s) but none is a table ({_KINDS}), e.g. {matched[0]!r}."
    if not glob.has_magic(pattern):
        return "does not exist."
    folder = os.path.dirname(pattern)
    if folder and not glob.has_magic(folder) and not os.path.isdir(folder):
        return f"matches no file: the folder {folder!r} does not exist."
    return "matches no file."


@dataclass
class Part:
    """Columns of some rows of one file, with where they came from (for messages)."""

    table: Any  # pyarrow.Table
    file: str
    where: str  # "row group 3" or "lines 2-1001"
    first_line: int | None  # CSV: the line of the first row (1-based), for messages


def csv_convert(null_values: Sequence[str]) -> Any:
    """The CSV conversion options: exactly ``null_values`` are nulls (in every column, text ones too), not
    pyarrow's default list of guessed tokens (``n/a``, ``NULL``, ``nan``, ...)."""
    return _pa().csv.ConvertOptions(null_values=list(null_values), strings_can_be_null=True)


def not_empty(path: str) -> None:
    """Refuse a 0-byte file by name (pyarrow's own message names no file).

    Raises:
        DataError: naming the file.
    """
    if _filesystems.size(path) == 0:
        kind = "Parquet file" if path.endswith(_PARQUET) else "CSV file with a header line or `csv_columns`"
        raise DataError(f"{path}: the file is empty (0 bytes), a {kind} was expected.")


def open_parquet(path: str) -> Any:
    """``pyarrow.parquet.ParquetFile(path)`` (a local path or an object-storage URL), its errors naming the file.

    Raises:
        DataError: an empty or unreadable file, named.
    """
    pa = _pa()
    not_empty(path)
    try:
        return pa.parquet.ParquetFile(_filesystems.source(path), pre_buffer=_filesystems.is_url(path))
    except (pa.ArrowInvalid, OSError) as err:
        if _filesystems.is_url(path) and isinstance(err, (FileNotFoundError, PermissionError)):
            raise  # a bucket's error, already named by the filesystem layer
        raise DataError(f"{path}: not a readable Parquet file ({err}).") from None


def read_table(
    path: str,
    columns: Sequence[str],
    csv_columns: Sequence[str] | None = None,
    delimiter: str | None = None,
    null_values: Sequence[str] = ("",),
) -> list[Part]:
    """The ``columns`` of file ``path``: Parquet one part per row group, CSV one part; ``null_values``: the CSV
    fields that are nulls.

    Raises:
        DataError: naming the file and the columns it lacks, or an empty, header-only or unreadable file.
    """
    pa = _pa()
    not_empty(path)
    if path.endswith(_PARQUET):
        pf = open_parquet(path)
        have = set(pf.schema_arrow.names)
        missing = [c for c in columns if c not in have]
        if missing:
            raise DataError(f"{path}: no column {', '.join(map(repr, missing))} (it has {sorted(have)}).")
        if pf.metadata.num_rows == 0:
            raise DataError(f"{path}: no rows.")
        return [
            Part(pf.read_row_group(g, columns=list(columns)), path, f"row group {g}", None)
            for g in range(pf.num_row_groups)
        ]
    tsv = any(path.endswith(s) for s in (".tsv", ".tsv.gz"))
    read = pa.csv.ReadOptions(column_names=list(csv_columns) if csv_columns else None)
    parse = pa.csv.ParseOptions(delimiter=delimiter or ("\t" if tsv else ","))
    try:
        table = pa.csv.read_csv(
            _filesystems.source(path), read_options=read, parse_options=parse, convert_options=csv_convert(null_values)
        )
    except pa.ArrowInvalid as err:
        raise DataError(f"{path}: not a readable CSV file: {err}") from None
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise DataError(f"{path}: no column {', '.join(map(repr, missing))} (it has {table.column_names}).")
    if table.num_rows == 0:
        raise DataError(f"{path}: no rows: line 1 is the header and no line follows it.")
    return [Part(table.select(list(columns)), path, "", 1 if csv_columns else 2)]


def column_names(path: str, csv_columns: Sequence[str] | None = None, delimiter: str | None = None) -> list[str]:
    """The columns file ``path`` has (Parquet: its schema; CSV: ``csv_columns`` or its header line), read without
    its rows.

    Raises:
        DataError: an empty or unreadable file, named.
    """
    pa = _pa()
    not_empty(path)
    if path.endswith(_PARQUET):
        return list(open_parquet(path).schema_arrow.names)
    if csv_columns:
        return list(csv_columns)
    tsv = any(path.endswith(s) for s in (".tsv", ".tsv.gz"))
    parse = pa.csv.ParseOptions(delimiter=delimiter or ("\t" if tsv else ","))
    try:
        with pa.csv.open_csv(_filesystems.source(path), parse_options=parse) as reader:
            return list(reader.schema.names)
    except pa.ArrowInvalid as err:
        raise DataError(f"{path}: not a readable CSV file: {err}") from None


def _at(part: Part, row: int) -> str:
    if part.first_line is not None:
        return f"{part.file}, line {part.first_line + row}"
    return f"{part.file}, {part.where}, row {row}"


class _Bad:
    """Rows found bad while decoding a part: an error (``bad_rows: error``) or a mask (``drop``)."""

    def __init__(self, part: Part, drop: bool) -> None:
        self.part, self.drop = part, drop
        self.mask = np.zeros(part.table.num_rows, dtype=bool)

    def found(self, rows: np.ndarray, column: str, problem: str, values: Sequence[Any], fill: bool = False) -> None:
        if not len(rows):
            return
        if not self.drop:
            fix = f"set `fill: {{{column}: 0.0}}` (or `mean`, the training split's mean) to fill it, " if fill else ""
            raise DataError(
                f"{_at(self.part, int(rows[0]))}: column {column!r}: {problem} (value {values[0]!r}"
                f"{f'; {len(rows)} such rows in this part' if len(rows) > 1 else ''}). HINT: fix the data, {fix}or "
                "set `bad_rows: drop` to drop such rows (they are counted)."
            )
        self.mask[rows] = True


def _numbers(part: Part, column: str, bad: _Bad, kind: str, missing_ok: bool = False) -> np.ndarray:
    """A numeric column as float64. Nulls and NaN are bad rows, or with ``missing_ok`` missing values (kept as NaN,
    for ``fill``); inf is always a bad row."""
    pa = _pa()
    col = part.table.column(column).combine_chunks()
    if pa.types.is_null(col.type):  # every field a null token
        col = pa.nulls(len(col), pa.float64())
    if _is_text(col.type) and part.first_line is not None:  # CSV: a field pyarrow could not read as a number
        col = _parse_text(part, column, col, pa.float64(), kind)
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type)):
        first = f"; value {col[0].as_py()!r}" if len(col) else ""
        raise DataError(f"{_at(part, 0)}: column {column!r} is {col.type}, a number was expected ({kind}{first}).")
    values = col.to_numpy(zero_copy_only=False).astype(np.float64)  # nulls become NaN
    if missing_ok:
        rows = np.flatnonzero(np.isinf(values))
        bad.found(rows, column, "inf", [col[int(i)].as_py() for i in rows[:1]])
        return np.where(np.isinf(values), 0.0, values)
    rows = np.flatnonzero(~np.isfinite(values))
    bad.found(rows, column, "null, NaN or inf", [col[int(i)].as_py() for i in rows[:1]], kind == "dense")
    return np.where(np.isfinite(values), values, 0.0)


def _is_text(t: Any) -> bool:
    pa = _pa()
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def _parse_text(part: Part, column: str, col: Any, to: Any, kind: str) -> Any:
    """A CSV text column read as type ``to``; the first field that does not read names its line and value."""
    pa = _pa()
    try:
        return pa.compute.cast(col, to)
    except pa.ArrowInvalid:
        pass
    good, bad = 0, len(col)  # the first `good` fields read, the first `bad` do not: a binary search of prefixes
    while bad - good > 1:
        mid = (good + bad) // 2
        try:
            pa.compute.cast(col.slice(0, mid), to)
            good = mid
        except pa.ArrowInvalid:
            bad = mid
    value = col[good].as_py()
    what = "a number" if pa.types.is_floating(to) else "a number, an ISO date or an ISO date and time"
    raise DataError(
        f"{_at(part, good)}: column {column!r}: {value!r} is not {what} ({kind}). HINT: if it marks a missing value, "
        f'declare it a null token: `csv_null_values: ["", {json.dumps(value)}]`.'
    )


def _temporal(t: Any) -> bool:
    pa = _pa()
    return bool(pa.types.is_timestamp(t) or pa.types.is_date(t))


def _stamps(part: Part, column: str, bad: _Bad) -> np.ndarray:
    """The split rule's time column: numbers (float64) or, for an Arrow timestamp or date column (or CSV text in
    ISO 8601 that pyarrow did not read as one), ``datetime64`` (UTC for a column with a time zone)."""
    pa = _pa()
    col = part.table.column(column).combine_chunks()
    if _is_text(col.type) and part.first_line is not None:
        first = col.drop_null()
        try:
            float(first[0].as_py() if len(first) else "0")
        except ValueError:  # text that is not a number: dates or times, or the first bad field is named
            col = _parse_text(part, column, col, pa.timestamp("us"), "timestamp")
    if not _temporal(col.type):
        return _numbers(part, column, bad, "timestamp")
    values = col.to_numpy(zero_copy_only=False)
    nulls = np.flatnonzero(np.isnat(values))
    bad.found(nulls, column, "null timestamp", [None] * len(nulls))
    return np.where(np.isnat(values), np.zeros(1, dtype=values.dtype), values)


def _integer_ids(part: Part, column: str, values: Any, row_of: np.ndarray, bad: _Bad) -> Any:
    """``ids: raw`` ids that came as text (a CSV column with a stray word, a Parquet string column): integers written
    in decimal become int64; any other text is a bad row (``row_of``: each value's row), named with its value."""
    pa = _pa()
    integers, bits = integer_text(values)
    rows = np.unique(row_of[~integers])
    if len(rows):
        first = int(np.flatnonzero(~integers)[0])
        bad.found(
            rows,
            column,
            "text in an integer id column (ids: raw reads each id as its row; for text ids declare ids: hash or vocab)",
            [values[first].as_py()],
        )
    return pa.array(np.where(integers, bits.view(np.int64), 0))


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


def _decode_sparse(part: Part, spec: SparseColumn, bad: _Bad) -> tuple[Any, np.ndarray, np.ndarray | None]:
    """``(ids, lengths, weights)`` of one sparse column: ids still raw (numpy), per-row lengths, flat weights."""
    pa = _pa()
    col = part.table.column(spec.column).combine_chunks()
    n = len(col)
    if part.first_line is not None and pa.types.is_null(col.type):  # CSV: every field empty (a null token)
        col = col.cast(pa.string())
    if not spec.list:
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            raise DataError(f"{part.file}: column {spec.column!r} is {col.type}; declare it `list: true`.")
        nulls = np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))
        bad.found(nulls, spec.column, "null id", [None] * len(nulls))
        filled = col.fill_null(0) if pa.types.is_integer(col.type) else col.fill_null("")
        if spec.ids == "raw" and _is_text(filled.type):
            filled = _integer_ids(part, spec.column, filled, np.arange(n), bad)
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
    if spec.ids == "raw" and _is_text(flat.type):
        flat = _integer_ids(part, spec.column, flat, np.repeat(np.arange(n), lengths), bad)
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
class Decoded:
    """One part's rows as columns, ids not yet mapped."""

    labels: np.ndarray  # (N, L) float
    dense: np.ndarray  # (N, D) float, not transformed
    sparse: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]  # feature -> (raw ids, lengths, weights)
    timestamps: np.ndarray | None
    keep: np.ndarray  # rows that are good
    keys: Any = None  # pyarrow.Table: the rows' key columns (predict --output), where read


def decode(
    part: Part,
    schema: Schema,
    drop: bool,
    timestamp: str | None,
    fill: Collection[str] = (),
    *,
    labels: bool = True,
    keys: bool = False,
) -> Decoded:
    """The schema's columns of ``part`` (and the ``timestamp`` column), checked; bad rows raise, or with ``drop``
    are marked in ``keep``. Missing values (null, NaN) of the dense columns in ``fill`` stay NaN, to be filled.
    Without ``labels`` (a file scored that has no label column) the labels are 0; with ``keys`` the schema's key
    columns are kept as they are, for the rows' scores."""
    bad = _Bad(part, drop)
    if labels:
        label_values = np.stack([c.apply(_numbers(part, c.column, bad, "label")) for c in schema.labels], axis=1)
    else:
        label_values = np.zeros((part.table.num_rows, len(schema.labels)), dtype=np.float32)
    dense = (
        np.stack([_numbers(part, c.column, bad, "dense", c.column in fill) for c in schema.dense], axis=1)
        if schema.dense
        else np.zeros((part.table.num_rows, 0))
    )
    sparse = {c.feature: _decode_sparse(part, c, bad) for c in schema.sparse}
    stamps = _stamps(part, timestamp, bad) if timestamp else None
    key_table = part.table.select(schema.keys) if keys and schema.keys else None
    return Decoded(label_values, dense, sparse, stamps, ~bad.mask, key_table)


def concat_jagged(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None]]) -> tuple[Any, ...]:
    """One sparse column's ``(ids, lengths, weights)`` of several parts, concatenated."""
    ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    lengths = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    weights = None if not parts or parts[0][2] is None else np.concatenate([p[2] for p in parts])
    return ids, lengths, weights


def rows_of(lengths: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Mask of the values whose row is kept."""
    return np.repeat(keep, lengths)


def take(d: Decoded, mask: np.ndarray) -> Decoded:
    """The rows ``mask`` of ``d`` (all of them good)."""
    sparse = {}
    for feature, (ids, lengths, weights) in d.sparse.items():
        values = rows_of(lengths, mask)
        sparse[feature] = (ids[values], lengths[mask], None if weights is None else weights[values])
    stamps = None if d.timestamps is None else d.timestamps[mask]
    keys = None if d.keys is None else d.keys.filter(_pa().array(mask))
    return Decoded(d.labels[mask], d.dense[mask], sparse, stamps, np.ones(int(mask.sum()), dtype=bool), keys)


class Mapper:
    """Decoded columns to a :class:`~lightning_rec.data.base.RecDataset`: ids mapped, dense transformed. Holds only
    the schema and what the training split taught, so DataLoader workers get a small copy."""

    def __init__(
        self,
        schema: Schema,
        vocabularies: dict[str, Vocabulary],
        dense_stats: dict[str, tuple[float, float]],
        fills: dict[str, float] | None = None,
    ):
        self.schema, self.vocabularies, self.dense_stats = schema, vocabularies, dense_stats
        self.fills = dict(fills or {})  # dense column -> the value its missing values take

    def dataset(self, d: Decoded) -> RecDataset:
        """The rows of ``d`` as a dataset: ids mapped, dense columns transformed."""
        sparse: dict[str, _Column] = {}
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
            np.stack(
                [self._dense(c).apply(self._filled(c, d.dense[:, i])) for i, c in enumerate(self.schema.dense)], axis=1
            )
            if self.schema.dense
            else np.zeros((len(d.labels), 0), dtype=np.float32)
        )
        labels = d.labels[:, 0] if d.labels.shape[1] == 1 else d.labels
        return RecDataset(
            torch.from_numpy(np.ascontiguousarray(dense)), torch.from_numpy(labels.astype(np.float32)), sparse, weights
        )

    def _filled(self, c: DenseColumn, x: np.ndarray) -> np.ndarray:
        return np.where(np.isnan(x), self.fills[c.column], x) if c.column in self.fills else x

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


def where(unit: Unit) -> str:
    """Where a unit's rows come from, for messages (``row group N``; empty for CSV)."""
    return f"row group {unit.row_group}" if unit.row_group is not None else ""


class UnitReader:
    """Rows ``[a, b)`` of a unit as a dataset (what :class:`~lightning_rec.data.stream.TableStream` reads), keeping
    the last unit read: consecutive windows of a worker usually fall in the same unit.

    With ``kept`` (``bad_rows: drop``: per unit that has bad rows, which of its rows are kept, found by one pass
    before the epoch; such a unit's ``rows`` counts its kept rows), ``a`` and ``b`` count kept rows: the reader reads
    the raw rows that hold them and leaves the others out, so batch bounds, and a mid-epoch resume, stay exact."""

    def __init__(
        self,
        mapper: Mapper,
        columns: list[str],
        csv_columns: Any,
        delimiter: Any,
        bad_rows: str,
        null_values: Sequence[str] = ("",),
        kept: dict[Unit, np.ndarray] | None = None,
    ) -> None:
        self.mapper, self.columns, self.csv_columns, self.delimiter = mapper, columns, csv_columns, delimiter
        self.drop = bad_rows == "drop"
        # unit -> positions of its kept rows (only the units with bad rows: a file without any costs nothing)
        self.kept = {unit: np.flatnonzero(mask) for unit, mask in (kept or {}).items()}
        self.null_values = list(null_values)
        self._last: tuple[Unit, Any] | None = None
        self._environment = _filesystems.environment()  # object storage's credentials, for the workers

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_last": None, "_adopted": False}

    def __call__(self, unit: Unit, a: int, b: int) -> RecDataset:
        if not self.__dict__.get("_adopted", True):  # a worker process: the loader's process's variables
            _filesystems.adopt_environment(self._environment)
            self._adopted = True
        if self._last is None or self._last[0] != unit:
            self._last = (unit, read_unit(unit, self.columns, self.csv_columns, self.delimiter, self.null_values))
        raw = self.kept.get(unit)
        if raw is not None:  # a, b count kept rows: read the raw rows that hold them
            raw = raw[a:b]
            a, b = (int(raw[0]), int(raw[-1]) + 1) if len(raw) else (0, 0)
        table = self._last[1].slice(a, b - a)
        first = None if unit.first_line is None else unit.first_line + a
        part = Part(table, unit.file, f"{where(unit)} from row {a}" if unit.row_group is not None else "", first)
        decoded = decode(part, self.mapper.schema, self.drop, None, self.mapper.fills)
        if raw is not None:
            mask = np.zeros(b - a, dtype=bool)
            mask[raw - a] = True
            decoded = take(decoded, mask)
        return self.mapper.dataset(decoded)
