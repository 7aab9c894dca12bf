"""Raw ids at serving: how a raw request (a ``user_id`` as the click log holds it, a price with a missing value)
becomes the tensors training gave the model, recorded in the artifact and applied by :class:`RequestEncoder`.

A model trained on a :class:`~lightning_rec.data.TabularDataModule` saw rows, not ids: ``hash`` ids hashed into
their table, ``vocab`` values looked up in the training split's vocabulary (row 0 for any other), dense columns
transformed with the training split's statistics and their missing values filled. The DataModule keeps what it
learned (and the schema and ``fill`` it applies to) in its ``state_dict``, which Lightning saves in every
checkpoint; :func:`~lightning_rec.serving.export_inference` writes it into the artifact's spec as ``raw_inputs``
(:func:`raw_inputs_record`), a versioned, self-describing record (JSON, in ``extra/lightning_rec.json`` of both
formats)::

    {"version": 1,
     "hash": {"integers": {"algorithm": "splitmix64", ...}, "text": {"algorithm": "fnv1a_64", ...}, ...},
     "sparse": [{"feature": "user_id", "column": "user_id", "ids": "hash", "num_embeddings": 1000000, ...},
                {"feature": "item_id", "column": "item_id", "ids": "vocab", "vocabulary": "item_id",
                 "num_embeddings": 5001, "out_of_vocabulary_row": 0, ...},
                {"feature": "tags", "column": "tags", "ids": "hash", "list": true, "weights": "tag_weights", ...}],
     "dense": [{"column": "price", "transform": "log1p", "mean": null, "std": null, "fill": 0.0}, ...],
     "vocabularies": {"item_id": ["i17", "i3", ...]}}          # value i is row i + 1

:class:`RequestEncoder` (and :func:`encode_request`) turns a request's columns into the artifact's arguments through
the very functions the DataModule decodes and maps its files with (``lightning_rec.data``: the hash, the vocabulary
lookup, the transforms, the fills), so the ids and values are those training used, bit for bit, whatever later
versions change in them. A server without Python reimplements the record; ``examples/serve_cpp/hash_ids.h`` is the
hash in C++.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_rec.data._tabular_read import Mapper, Part, decode
from lightning_rec.data.schema import DataError, DenseColumn, LabelColumn, Schema, SparseColumn, Vocabulary
from lightning_rec.errors import ServingError
from lightning_rec.serving.artifact import InferenceSpec, serving_inputs

__all__ = [
    "HASH",
    "RAW_INPUTS_VERSION",
    "RequestEncoder",
    "datamodule_state",
    "encode_request",
    "raw_inputs_record",
]

RAW_INPUTS_VERSION = 1

# What `lightning_rec.data.schema.hash_ids` computes (tests/test_serving_requests.py recomputes it from these
# constants alone, against the DataModule's own hashing): the record's readers (a C++ server) implement this.
HASH: dict[str, Any] = {
    "integers": {
        "algorithm": "splitmix64",
        "input": "the id as a signed 64-bit integer, its two's complement bits as unsigned",
        "steps": [
            "z = x + 0x9E3779B97F4A7C15",
            "z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9",
            "z = (z ^ (z >> 27)) * 0x94D049BB133111EB",
            "z = z ^ (z >> 31)",
        ],
    },
    "text": {
        "algorithm": "fnv1a_64",
        "input": "the id's UTF-8 bytes, zero bytes skipped",
        "offset_basis": "0xCBF29CE484222325",
        "prime": "0x100000001B3",
        "steps": ["z = offset_basis", "for each byte b: z = (z ^ b) * prime"],
        "integer_text": (
            "text that is an integer written in decimal (the whole text matches -?[0-9]+, ASCII digits, and its value "
            "is in [-2**63, 2**64)) is that integer: hashed as `integers` are, its value taken modulo 2**64"
        ),
    },
    "arithmetic": "unsigned 64-bit, wrapping",
    "seed": None,  # none: the constants are fixed, the rows the same in every process, run and machine
    "row": "z % num_embeddings",
}

# The label the DataModule's decoding requires of every row; a request has none (its value is never used).
_NO_LABEL = "__lightning_rec_request_label__"


def datamodule_state(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``TabularDataModule`` state a checkpoint's metadata holds (Lightning saves a DataModule's ``state_dict``
    under its class name), or ``None`` (trained without one, or before the state held its schema)."""
    found = [
        v for v in meta.values() if isinstance(v, Mapping) and {"schema", "vocabularies", "dense_stats"} <= v.keys()
    ]
    return found[0] if len(found) == 1 else None


def raw_inputs_record(state: Mapping[str, Any]) -> dict[str, Any]:
    """The ``raw_inputs`` record (see the module docstring) of a ``TabularDataModule``'s ``state_dict()``: each
    sparse feature's column and id mapping (hash and its size, vocabulary, raw), list and weights, each dense
    column's transform with its mean and std and the value its missing values take.

    Example::

        >>> state = {"schema": {"labels": [{"column": "y"}], "dense": [{"column": "p", "transform": "log1p"}],
        ...                     "sparse": [{"column": "u", "ids": "hash", "num_embeddings": 10}]},
        ...          "vocabularies": {}, "dense_stats": {}, "fill_means": {}, "fill": {"p": 0.0}}
        >>> record = raw_inputs_record(state)
        >>> record["sparse"][0]["num_embeddings"], record["dense"][0]["fill"]
        (10, 0.0)
    """
    schema = Schema(**dict(state["schema"]))
    vocabularies = {str(t): [str(v) for v in values] for t, values in state.get("vocabularies", {}).items()}
    stats = state.get("dense_stats", {})
    fill, means = dict(state.get("fill", {})), dict(state.get("fill_means", {}))
    sparse = []
    used: dict[str, list[str]] = {}
    for c in schema.sparse:
        table = c.table or c.feature
        entry: dict[str, Any] = {
            "feature": c.feature,
            "column": c.column,
            "ids": c.ids,
            "table": table,
            "list": c.list,
            "delimiter": c.delimiter,
            "weights": c.weights,
        }
        if c.ids == "vocab":
            if table not in vocabularies:
                raise ValueError(
                    f"the DataModule's state has no vocabulary for table {table!r} (feature {c.feature!r})"
                )
            used[table] = vocabularies[table]
            entry.update(vocabulary=table, num_embeddings=len(used[table]) + 1, out_of_vocabulary_row=0)
        else:
            entry["num_embeddings"] = int(c.num_embeddings or 0)
            if c.ids == "hash":
                entry["hash"] = {"integers": HASH["integers"]["algorithm"], "text": HASH["text"]["algorithm"]}
        sparse.append(entry)
    dense = []
    for d in schema.dense:
        mean, std = d.mean, d.std
        if d.transform == "standardize" and (mean is None or std is None):
            mean, std = (float(x) for x in stats[d.column])
        value = fill.get(d.column)
        dense.append(
            {
                "column": d.column,
                "transform": d.transform,
                "mean": mean,
                "std": std,
                "fill": float(means[d.column]) if value == "mean" else (None if value is None else float(value)),
            }
        )
    return {"version": RAW_INPUTS_VERSION, "hash": HASH, "sparse": sparse, "dense": dense, "vocabularies": used}


def checked_record(
    state: Mapping[str, Any] | None, features: Sequence[str], num_dense_features: int, weighted: bool
) -> dict[str, Any] | None:
    """:func:`raw_inputs_record` of ``state`` if it describes the served network's inputs (every feature it reads,
    its dense width), else ``None`` with a warning naming what differs: export does not fail for a mapping it cannot
    record."""
    if state is None:
        return None
    record = raw_inputs_record(state)
    have = {e["feature"]: e for e in record["sparse"]}
    problems = []
    missing = [f for f in features if f not in have]
    if missing:
        problems.append(f"the network reads features {missing} the DataModule does not make (it makes {list(have)})")
    if num_dense_features and num_dense_features != len(record["dense"]):
        problems.append(
            f"the network reads {num_dense_features} dense features, the DataModule makes {len(record['dense'])}"
        )
    if problems:
        warnings.warn(
            "export_inference: the checkpoint's TabularDataModule state is not recorded in the artifact "
            f"(raw_inputs): {'; '.join(problems)}. HINT: map raw ids as your own pipeline did, then call "
            "serving_inputs().",
            stacklevel=3,
        )
        return None
    return record


class RequestEncoder:
    """A raw request -> the artifact's arguments ``(dense_features, values, lengths[, weights])``, as training made
    them: build it once per artifact (vocabularies are indexed here), call it per request.

    A request is one row per sample, as columns: a mapping of column name -> values (a list, a NumPy array), a
    ``pyarrow.Table`` or a pandas ``DataFrame``. It holds the column of each sparse feature the artifact reads (ids
    as integers or text, as in the training files; a list per sample for a list feature, the weights' column too
    for a weighted artifact) and, when the artifact reads dense features, each dense column (``None``/NaN where
    missing: filled with the value training filled it with; a column with a fill may be left out). Other columns
    are ignored. A ``hash`` id never seen in training still has its row, a ``vocab`` value outside the vocabulary
    reads row 0 (out of vocabulary), as in training.

    Args:
        spec: the artifact's :class:`InferenceSpec` (``inference_spec(path)``, ``pt2_spec(path)``,
            ``load_pt2(path).spec``) or the artifact's path.

    Raises:
        ServingError: the artifact records no raw-input mapping (its checkpoint was not trained with a
            ``TabularDataModule``), or one of a version this lightning_rec does not read.

    Example::

        encode = RequestEncoder("model_int8.pt2")
        model = load_pt2("model_int8.pt2")
        probabilities = model(*encode({"user_id": [42, 7], "item_id": ["i17", "i3"], "price": [9.99, None]}))
    """

    def __init__(self, spec: InferenceSpec | str | Path) -> None:
        self.spec = _spec(spec)
        record = self.spec.raw_inputs
        if record is None:
            raise ServingError(
                f"the artifact ({self.spec.model}) records no raw-input mapping: its checkpoint was not trained with a "
                "TabularDataModule, or was exported before lightning_rec recorded it. HINT: export it again from a "
                "checkpoint of a TabularDataModule run, or map the ids as your pipeline did and call serving_inputs()."
            )
        if record.get("version") != RAW_INPUTS_VERSION:
            raise ServingError(
                f"the artifact's raw_inputs record is version {record.get('version')!r}; this lightning_rec reads "
                f"version {RAW_INPUTS_VERSION}. HINT: encode with the lightning_rec that exported it."
            )
        reads = set(self.spec.features)
        sparse = [
            SparseColumn(
                column=e["column"],
                ids=e["ids"],
                num_embeddings=e["num_embeddings"],
                table=e["table"] if e["table"] != e["feature"] and e["table"] in reads else None,
                list=e["list"],
                delimiter=e["delimiter"],
                weights=e["weights"] if self.spec.weighted else None,
                name=e["feature"],
            )
            for e in record["sparse"]
            if e["feature"] in reads
        ]
        dense = [
            DenseColumn(d["column"], d["transform"], d["mean"], d["std"])
            for d in (record["dense"] if self.spec.num_dense_features else [])
        ]
        self.schema = Schema(labels=[LabelColumn(_NO_LABEL)], dense=dense, sparse=sparse)
        self.fills: dict[str, float] = {
            d["column"]: float(d["fill"]) for d in record["dense"] if d["fill"] is not None and dense
        }
        tables = {e["feature"]: e.get("vocabulary") for e in record["sparse"] if e["feature"] in reads}
        vocabularies = {
            c.table or c.feature: Vocabulary(record["vocabularies"][tables[c.feature]])
            for c in sparse
            if c.ids == "vocab"
        }
        self._mapper = Mapper(self.schema, vocabularies, {}, self.fills)

    @property
    def columns(self) -> list[str]:
        """The request columns read: each sparse feature's (and its weights', for a weighted artifact) and each
        dense column (those with a fill value may be absent)."""
        return [c for c in self.schema.columns if c != _NO_LABEL]

    def batch(self, rows: Any) -> Any:
        """The request as the :class:`~lightning_rec.Batch` the DataModule would have made of the same rows (its
        ``sparse_features`` ``KeyedJaggedTensor``, weights included, and ``dense_features``; labels are zeros)."""
        table = self._table(rows)
        part = Part(table, "request", f"{table.num_rows} rows", None)
        try:
            decoded = decode(part, self.schema, False, None, self.fills)
        except DataError as err:  # the DataModule's advice (bad_rows, fill) is for training data
            raise DataError(str(err).split(" HINT:")[0]) from None
        dataset = self._mapper.dataset(decoded)
        return dataset[torch.arange(len(dataset))]

    def __call__(self, rows: Any) -> tuple[Tensor, ...]:
        """The artifact's arguments for ``rows``: ``model(*encoder(rows))``."""
        batch = self.batch(rows)
        return serving_inputs(self.spec, batch.sparse_features, batch.dense_features)

    def _table(self, rows: Any) -> Any:
        import pyarrow as pa

        if isinstance(rows, Mapping):
            columns = {}
            for name in self.columns:
                if name not in rows:
                    continue
                try:
                    columns[name] = pa.array(list(rows[name]) if not isinstance(rows[name], np.ndarray) else rows[name])
                except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as err:
                    raise DataError(
                        f"request: column {name!r}: {err} (one type per column: integer or text ids, a list per "
                        "sample for a list feature, numbers for a dense column)"
                    ) from None
            sizes = {name: len(c) for name, c in columns.items()}
            if len(set(sizes.values())) > 1:
                raise DataError(f"request: columns of different lengths: {sizes}.")
            table = pa.table(columns) if columns else pa.table({})
        else:
            table = rows if isinstance(rows, pa.Table) else pa.table(rows)
        missing = [c for c in self.columns if c not in table.column_names and c not in self.fills]
        if missing:
            raise DataError(
                f"request: no column {', '.join(map(repr, missing))} (it has {table.column_names}); the artifact "
                f"reads {self.columns}."
            )
        n = table.num_rows
        if n == 0:
            raise DataError("request: no rows.")
        for c in self.fills:
            if c not in table.column_names:  # left out: every value missing, filled as in training
                table = table.append_column(c, pa.nulls(n, pa.float64()))
        return table.append_column(_NO_LABEL, pa.array(np.zeros(n))).select(self.schema.columns)


def encode_request(spec: InferenceSpec | str | Path, rows: Any) -> tuple[Tensor, ...]:
    """``RequestEncoder(spec)(rows)``: a raw request's columns -> the artifact's arguments, as training mapped them
    (see :class:`RequestEncoder`; a server builds the encoder once).

    Example::

        model = torch.jit.load("model_int8.pt")
        probabilities = model(*encode_request("model_int8.pt", {"user_id": [42], "item_id": ["i17"]}))
    """
    return RequestEncoder(spec)(rows)


def _spec(spec: InferenceSpec | str | Path) -> InferenceSpec:
    if isinstance(spec, InferenceSpec):
        return spec
    from lightning_rec.serving.artifact import inference_spec
    from lightning_rec.serving.pt2 import pt2_spec

    return pt2_spec(spec) if str(spec).endswith(".pt2") else inference_spec(spec)
