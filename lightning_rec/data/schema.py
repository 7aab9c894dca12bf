"""A declared feature schema: which columns of a table are labels, dense features and sparse features, and how each
becomes model input. :class:`~lightning_rec.data.tabular.TabularDataModule` reads Parquet and CSV through it.

In YAML (a ``TabularDataModule``'s ``schema``)::

    schema:
      labels: [{column: rating, threshold: 4.0}]            # label = rating >= 4
      dense:
        - {column: price, transform: log1p}
        - {column: age, transform: standardize}              # mean/std of the training split, stored
      keys: [user_id, item_id]                               # written beside each score (predict --output)
      sparse:
        - {column: user_id, ids: hash, num_embeddings: 1000000}
        - {column: item_id, ids: vocab}                       # first pass over the training split
        - {column: history, ids: vocab, table: item_id, list: true}   # shares item_id's table
        - {column: tags, ids: hash, num_embeddings: 10000, list: true, weights: tag_weights}
        - {column: country, ids: raw, num_embeddings: 250}

Ids become rows per feature:

* ``hash``: a stable 64-bit hash (the same in every process and run; integers by value, text by its bytes) modulo
  ``num_embeddings``;
* ``vocab``: row ``i + 1`` for the ``i``-th value of the vocabulary, row 0 for values it lacks (out of vocabulary).
  The vocabulary is read from ``vocab_file`` (one value per line) or built from the training split (values by
  descending count, ties in sorted order, at least ``min_count`` occurrences) and kept in the DataModule's state,
  which Lightning saves in every checkpoint. Features sharing a table share its vocabulary;
* ``raw``: the value is the row (an integer below ``num_embeddings``; one outside it is for the strategy's
  ``bounds_check``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from lightning_rec._choices import check_choices
from lightning_rec.config import SparseFeature

__all__ = [
    "DataError",
    "DenseColumn",
    "DenseTransform",
    "IdMapping",
    "LabelColumn",
    "Schema",
    "SparseColumn",
    "Vocabulary",
    "hash_arrow",
    "hash_ids",
    "id_text",
    "integer_text",
]

IdMapping = Literal["hash", "vocab", "raw"]
DenseTransform = Literal["none", "log1p", "standardize"]


class DataError(ValueError):
    """Bad input data, named: the file, where in it (row group or line), the column and the value."""


@dataclass
class LabelColumn:
    """A label column: its values as floats, or ``value >= threshold`` as 0/1.

    Example::

        >>> LabelColumn("rating", threshold=4.0).apply(np.array([5.0, 3.0])).tolist()
        [1.0, 0.0]
    """

    column: str
    threshold: float | None = None

    def __post_init__(self) -> None:
        check_choices(self, f"Schema: label column {self.column!r}")

    def apply(self, values: np.ndarray) -> np.ndarray:
        """The labels of ``values`` (float32)."""
        values = values.astype(np.float64)
        return (
            (values >= self.threshold).astype(np.float32) if self.threshold is not None else values.astype(np.float32)
        )


@dataclass
class DenseColumn:
    """A dense feature column and its transform.

    Args:
        column: the column.
        transform: ``"none"``, ``"log1p"`` (negatives clipped to 0 first) or ``"standardize"`` (``(x - mean) / std``:
            given here, or computed on the training split and stored with the DataModule's state).
        mean, std: the standardisation's statistics (``None``: computed).

    Example::

        >>> DenseColumn("year", "standardize", mean=1990.0, std=10.0).apply(np.array([2000.0])).tolist()
        [1.0]
    """

    column: str
    transform: DenseTransform = "none"
    mean: float | None = None
    std: float | None = None

    def __post_init__(self) -> None:
        check_choices(self, f"Schema: dense column {self.column!r}")  # a misspelled transform is no transform

    def apply(self, values: np.ndarray) -> np.ndarray:
        """The transformed feature (float32)."""
        x = values.astype(np.float64)
        if self.transform == "log1p":
            x = np.log1p(np.clip(x, 0, None))
        elif self.transform == "standardize":
            if self.mean is None or self.std is None:
                raise ValueError(f"dense column {self.column!r}: standardize needs its mean and std (fit them first)")
            x = (x - self.mean) / (self.std if self.std > 0 else 1.0)
        return x.astype(np.float32)


@dataclass
class SparseColumn:
    """A sparse (categorical) feature column and how its ids become table rows.

    Args:
        column: the column; also the feature's name in the ``KeyedJaggedTensor`` unless ``name`` is set.
        ids: ``"hash"``, ``"vocab"`` or ``"raw"`` (see the module docstring).
        num_embeddings: rows of its table (``hash``, ``raw``; for ``vocab``: the vocabulary's size + 1).
        table: the table it shares (another feature's name; default: its own).
        list: a list-valued column (Parquet list, or ``delimiter``-separated text in CSV).
        delimiter: what separates a CSV list's values.
        weights: a column of per-id weights, a list as long as the id list (a weighted feature).
        vocab_file: for ``vocab``: a file with one value per line (row ``i + 1`` for line ``i``).
        min_count: for ``vocab`` built from data: values seen fewer times go to the out-of-vocabulary row.
        name: the feature's name (default: ``column``).
    """

    column: str
    ids: IdMapping = "hash"
    num_embeddings: int | None = None
    table: str | None = None
    list: bool = False
    delimiter: str = "|"
    weights: str | None = None
    vocab_file: str | None = None
    min_count: int = 1
    name: str | None = None

    def __post_init__(self) -> None:
        check_choices(self, f"Schema: sparse column {self.column!r}")
        if self.ids in ("hash", "raw") and (self.num_embeddings is None or self.num_embeddings < 1):
            raise ValueError(
                f"sparse column {self.column!r}: ids: {self.ids} needs num_embeddings >= 1, got {self.num_embeddings}."
            )
        if self.weights is not None and not self.list:
            raise ValueError(
                f"sparse column {self.column!r}: weights ({self.weights!r}) need a list column (list: true)."
            )

    @property
    def feature(self) -> str:
        """The feature's key in the ``KeyedJaggedTensor``."""
        return self.name or self.column


@dataclass
class Schema:
    """Labels, dense and sparse columns of a table (see the module docstring), and its key columns.

    Args:
        labels, dense, sparse: the columns the model reads.
        keys: columns that identify a row (e.g. ``[user_id, item_id]``), not model input: ``lightning-rec predict
            --output`` writes them beside each row's score, so scores join back to the rows they belong to. They
            may also be features; they are read from the files that are scored.

    Example::

        >>> s = Schema(labels=[LabelColumn("click")], sparse=[SparseColumn("user", num_embeddings=10)])
        >>> s.columns
        ['click', 'user']
    """

    labels: list[LabelColumn] = field(default_factory=list)
    dense: list[DenseColumn] = field(default_factory=list)
    sparse: list[SparseColumn] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.labels = [c if isinstance(c, LabelColumn) else LabelColumn(**c) for c in self.labels]
        self.dense = [c if isinstance(c, DenseColumn) else DenseColumn(**c) for c in self.dense]
        self.sparse = [c if isinstance(c, SparseColumn) else SparseColumn(**c) for c in self.sparse]
        check_choices(self, "Schema")
        if not self.labels:
            raise ValueError("Schema: at least one label column is needed (labels: [{column: ...}]).")
        if isinstance(self.keys, str) or not all(isinstance(k, str) and k for k in self.keys):
            raise ValueError(f"Schema: keys is {self.keys!r}: a list of column names, e.g. [user_id, item_id].")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"Schema: keys {self.keys} name a column twice.")
        self.keys = list(self.keys)
        names = [c.feature for c in self.sparse]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"Schema: sparse features {twice} are declared twice; give one a `name`.")
        for c in self.sparse:
            if c.table is not None and c.table not in names:
                raise ValueError(
                    f"Schema: sparse column {c.column!r} shares table {c.table!r}, which is no feature's name "
                    f"({names})."
                )

    @property
    def columns(self) -> list[str]:
        """Every column the schema reads, in declaration order, without repeats."""
        cols = [c.column for c in self.labels] + [c.column for c in self.dense]
        cols += [x for c in self.sparse for x in ([c.column] + ([c.weights] if c.weights else []))]
        return list(dict.fromkeys(cols))

    def sparse_features(self, vocab_sizes: Mapping[str, int]) -> list[SparseFeature]:
        """The features a model builds its tables from: one per sparse column, a shared table's size the largest
        of its features'. ``vocab_sizes``: by table (a feature's own name, or the one it shares)."""
        rows: dict[str, int] = {}
        for c in self.sparse:
            n = vocab_sizes[c.table or c.feature] + 1 if c.ids == "vocab" else int(c.num_embeddings or 0)
            table = c.table or c.feature
            rows[table] = max(rows.get(table, 0), n)
        return [
            SparseFeature(c.feature, rows[c.table or c.feature], multi_hot=c.list, table=c.table) for c in self.sparse
        ]


_FNV_OFFSET, _FNV_PRIME = np.uint64(0xCBF29CE484222325), np.uint64(0x100000001B3)
# An integer written as text: an optional minus sign and ASCII digits, nothing else (what pyarrow's CSV reader reads as
# an int64, but for its hexadecimal and blank-padded forms). Such text is the integer, so an id is the same whether its
# file's column came out as numbers or as text ("42" and 42).
_INTEGER_TEXT = r"^-?[0-9]+$"


def _splitmix(bits: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser of 64-bit patterns (uint64)."""
    with np.errstate(over="ignore"):
        z = bits + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def integer_text(values: Any) -> tuple[np.ndarray, np.ndarray]:
    """Which values of a ``pyarrow`` string array are integers written in decimal (``"42"``, ``"-7"``, ``"007"``;
    not ``"4.0"``, ``"+4"``, ``" 4"`` or ``"0x4"``), and their 64-bit patterns (int64 two's complement; an integer
    in ``[2**63, 2**64)`` as uint64; larger ones are not integers here).

    Example::

        >>> import pyarrow as pa
        >>> mask, bits = integer_text(pa.array(["42", "007", "abc", "-1", "4.0", None]))
        >>> mask.tolist(), bits[mask].astype(np.int64).tolist()
        ([True, True, False, True, False, False], [42, 7, -1])
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    mask = pc.match_substring_regex(values, _INTEGER_TEXT).fill_null(False).to_numpy(zero_copy_only=False)
    bits = np.zeros(len(values), dtype=np.uint64)
    at = np.flatnonzero(mask)
    if not len(at):
        return mask, bits
    text = values.take(pa.array(at))
    short = pc.less_equal(pc.utf8_length(text), 18).to_numpy(zero_copy_only=False)  # |value| < 10**18: an int64
    bits[at[short]] = pc.cast(text.filter(pa.array(short)), pa.int64()).to_numpy().view(np.uint64)
    for i, s in zip(at[~short].tolist(), text.filter(pa.array(~short)).to_pylist()):  # rare: Python's int decides
        value = int(s)
        if -(2**63) <= value < 2**64:
            bits[i] = np.uint64(value % 2**64)
        else:
            mask[i] = False
    return mask, bits


def hash_ids(values: np.ndarray, num_embeddings: int) -> np.ndarray:
    """Stable ids of ``values`` in ``[0, num_embeddings)``, the same in every process and run (unlike Python's
    ``hash``), vectorised: integers through SplitMix64 of their value (their 64-bit pattern), text through FNV-1a
    (64 bit) of its UTF-8 bytes, but text that is an integer written in decimal (see :func:`integer_text`) as that
    integer: ``"42"`` and ``42`` are one id.

    Example::

        >>> hash_ids(np.array([3, 3, 12]), 1000).tolist() == hash_ids(np.array([3, 3, 12]), 1000).tolist()
        True
        >>> int(hash_ids(np.array(["a"], dtype=object), 2**20)[0]) == int(hash_ids(np.array(["a"]), 2**20)[0])
        True
        >>> hash_ids(np.array(["42", "-7"]), 2**20).tolist() == hash_ids(np.array([42, -7]), 2**20).tolist()
        True
    """
    values = np.asarray(values)
    if values.dtype.kind in "iub":
        return (_splitmix(values.astype(np.int64).view(np.uint64)) % np.uint64(num_embeddings)).astype(np.int64)
    import pyarrow as pa

    text = np.char.decode(values, "utf-8") if values.dtype.kind == "S" else values.astype(str)
    return hash_arrow(pa.array(text.reshape(-1), pa.string()), num_embeddings)


def hash_arrow(values: Any, num_embeddings: int) -> np.ndarray:
    """:func:`hash_ids` of a ``pyarrow`` integer or string array, reading the string bytes in place (no Python string
    per value): the ids are those :func:`hash_ids` gives the same values. (``values: Any``: pyarrow is untyped.)

    Example::

        >>> import pyarrow as pa
        >>> hash_arrow(pa.array(["ab", "c"]), 97).tolist() == hash_ids(np.array(["ab", "c"]), 97).tolist()
        True
        >>> hash_arrow(pa.array(["42", "x"]), 97).tolist()[0] == hash_arrow(pa.array([42]), 97).tolist()[0]
        True
    """
    import pyarrow as pa

    arr = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        return hash_ids(arr.to_numpy(zero_copy_only=False), num_embeddings)
    n = len(arr)
    offsets_buffer, data_buffer = arr.buffers()[1], arr.buffers()[2]
    width = np.int64 if pa.types.is_large_string(arr.type) else np.int32
    offsets = np.frombuffer(offsets_buffer, dtype=width)[arr.offset : arr.offset + n + 1].astype(np.int64)
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, dtype=np.uint8)
    starts, lengths = offsets[:-1], np.diff(offsets)
    z = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(int(lengths.max()) if n else 0):
            on = lengths > j
            byte = data[starts[on] + j].astype(np.uint64)
            z[on] = np.where(byte != 0, (z[on] ^ byte) * _FNV_PRIME, z[on])
    integers, bits = integer_text(arr)
    z[integers] = _splitmix(bits[integers])
    return (z % np.uint64(num_embeddings)).astype(np.int64)


def id_text(values: Any) -> np.ndarray:
    """Ids as the text a :class:`Vocabulary` holds: integers (and text that is an integer written in decimal, see
    :func:`integer_text`) as ``str(int)``, other text as it is: ``42``, ``"42"`` and ``"042"`` are ``"42"``.

    Example::

        >>> id_text(np.array(["042", "a", "-0"])).tolist(), id_text(np.array([42])).tolist()
        (['42', 'a', '0'], ['42'])
    """
    import pyarrow as pa

    values = np.asarray(values)
    if values.dtype.kind in "iu":
        return values.astype(str).reshape(-1)
    text = values.astype(str).reshape(-1)
    integers, bits = integer_text(pa.array(text, pa.string()))
    if not integers.any():
        return text
    out = text.astype(object)
    signed = bits[integers].view(np.int64)
    big = (bits[integers] >= np.uint64(2**63)) & ~np.char.startswith(text[integers], "-")  # uint64, not negative
    out[integers] = np.where(big, bits[integers].astype(str), signed.astype(str))
    return out.astype(str)


class Vocabulary:
    """Values to rows: ``i + 1`` for the ``i``-th value, 0 for any other (out of vocabulary). Values are compared as
    :func:`id_text`: ``42``, ``"42"`` and ``"042"`` are one value.

    Example::

        >>> v = Vocabulary(["b", "a", "7"])
        >>> v.rows(np.array(["a", "c", "b"], dtype=object)).tolist(), v.rows(np.array([7])).tolist(), len(v)
        ([2, 0, 1], [3], 3)
    """

    def __init__(self, values: Sequence[str]) -> None:
        self.values = id_text(np.array([str(v) for v in values], dtype=str)).tolist() if len(values) else []
        order = np.argsort(np.array(self.values, dtype=str), kind="stable")
        self._sorted = np.array(self.values, dtype=str)[order]
        self._rows = (order + 1).astype(np.int64)

    def __len__(self) -> int:
        return len(self.values)

    def rows(self, values: np.ndarray) -> np.ndarray:
        """The rows of ``values`` (integers or text, compared as :func:`id_text`), vectorised (a binary search of the
        sorted values)."""
        text = id_text(values)
        if not self.values:
            return np.zeros(len(text), dtype=np.int64)
        at = np.searchsorted(self._sorted, text).clip(0, len(self._sorted) - 1)
        return np.where(self._sorted[at] == text, self._rows[at], 0)

    @classmethod
    def build(cls, counts: Mapping[str, int], min_count: int = 1) -> Vocabulary:
        """From value counts: by descending count, ties in sorted order, dropping values seen under ``min_count``."""
        kept = [v for v, n in counts.items() if n >= min_count]
        return cls(sorted(kept, key=lambda v: (-counts[v], v)))

    @classmethod
    def read(cls, path: str) -> Vocabulary:
        """One value per line."""
        with open(path, encoding="utf-8") as f:
            return cls([line.rstrip("\n") for line in f if line.rstrip("\n") != ""])

    def write(self, path: str) -> None:
        """One value per line (what :meth:`read` reads)."""
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(f"{v}\n" for v in self.values)
