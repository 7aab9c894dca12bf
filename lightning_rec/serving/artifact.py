"""What a serving artifact is and how it is called: its :class:`InferenceSpec` (``extra/lightning_rec.json`` in the
archive), the input check compiled into it (:func:`check_inputs`), the wrapper that turns plain tensors into the
``KeyedJaggedTensor`` the network takes, and the helpers that load one and build its arguments."""

# No `from __future__ import annotations` here: torch.fx and TorchScript read the forwards' annotations as types.
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec.serving.integrity import ARTIFACT_VERSION, check_version
from lightning_rec.serving.integrity import verify as verify_file

__all__ = [
    "ARTIFACT_VERSION",
    "SPEC_FILE",
    "InferenceSpec",
    "ServingWrapper",
    "SparseOnly",
    "assert_inputs",
    "check_inputs",
    "example_inputs",
    "inference_spec",
    "load_inference",
    "serving_inputs",
]

SPEC_FILE = "lightning_rec.json"


@dataclass(frozen=True)
class InferenceSpec:
    """What an artifact expects and holds (``extra/lightning_rec.json`` in the archive).

    Args:
        features: the sparse features, in the order of ``lengths`` (feature-major).
        num_dense_features: the width of ``dense_features`` (0: the network reads none, and the artifact takes no
            ``dense_features`` argument).
        weighted: whether ``weights`` are read (a collection pools with per-id weights).
        table_dtype: the tables' storage dtype.
        tables: table name -> ``[rows, columns]``.
        model: the LightningModule class it came from, and ``part`` (e.g. ``"query"``).
        bounds_check: what the artifact does with an id outside its table (see :func:`export_inference`).
        format: ``"torchscript"`` or ``"pt2"`` (see :func:`export_inference`).
        feature_rows: the ids each feature takes, in ``features`` order: its table's rows, or for a
            managed-collision feature (``raw_id_features``) the raw id space its collision module remaps.
        raw_id_features: the managed-collision features (raw ids, remapped to rows inside the artifact).
        max_lengths: the position-weighted features, with the most ids a sample may bring (its position weights).
        versions: the torch, fbgemm_gpu, torchrec and lightning_rec versions that wrote it (a ``.pt2`` package
            loads only under the same torch and FBGEMM: :func:`lightning_rec.serving.load_pt2` checks).
        raw_inputs: how a raw request's columns become the inputs, as training made them (each feature's column and
            id mapping: hash and its size, vocabulary, raw; each dense column's transform, statistics and fill
            value), recorded from the checkpoint's ``TabularDataModule``; ``None`` without one. Versioned; see
            :mod:`lightning_rec.serving.requests` and :class:`~lightning_rec.serving.RequestEncoder`.
        artifact_version: the version of this spec's layout (``ARTIFACT_VERSION``; 0: written before it was
            recorded); a loader refuses a newer one by name.
        checkpoint: the checkpoint it was exported from: ``{"step": global step, "id": the SHA-256 of its COMPLETE
            manifest}`` (one save, wherever it is copied); ``None`` for artifacts written before it was recorded.
        cpu: what a ``.pt2`` package's compiled code needs of the CPU, ``{"machine", "target", "features"}`` (the
            ``/proc/cpuinfo`` flags; see :mod:`lightning_rec.serving.cpu`); ``None`` for TorchScript (no compiled
            code) and for packages written before it was recorded.
    """

    features: list[str]
    num_dense_features: int
    weighted: bool
    table_dtype: str
    tables: dict[str, list[int]]
    model: str
    part: str | None = None
    bounds_check: str = "warn"  # artifacts written before the policy was recorded: FBGEMM's default
    format: str = "torchscript"
    feature_rows: list[int] | None = None  # the table rows of each feature, in `features` order
    raw_id_features: list[str] = field(default_factory=list)
    max_lengths: dict[str, int] = field(default_factory=dict)
    versions: dict[str, str] | None = None  # artifacts written before they were recorded: unknown
    raw_inputs: dict[str, Any] | None = None  # artifacts written before it was recorded, or without a TabularDataModule
    artifact_version: int = 0  # artifacts written before it was recorded
    checkpoint: dict[str, Any] | None = None
    cpu: dict[str, Any] | None = None


@torch.fx.wrap  # a leaf of the fx trace (it branches on values), compiled by TorchScript into the artifact
def check_inputs(
    values: Tensor,
    lengths: Tensor,
    features: list[str],
    rows: Tensor,
    raw_ids: list[bool] | None = None,
    max_lengths: Tensor | None = None,
) -> Tensor:
    """Raise a ``ValueError`` naming the problem when ``values``/``lengths`` do not fit the artifact: a ``lengths``
    that is not one entry per (feature, sample), a negative length, a sample with more ids than its feature's
    position weights cover (``max_lengths``, per feature, when given), lengths that do not add up to ``values``, or
    an id outside its feature's table (``rows``: the table's rows per feature; for a feature whose ``raw_ids`` entry
    is true, a managed-collision table's, the raw id space its collision module remaps: ``input_hash_size``).
    Returns ``values``.

    Example::

        >>> check_inputs(torch.tensor([3, 9]), torch.tensor([1, 1]), ["user", "item"], torch.tensor([10, 5]))
        Traceback (most recent call last):
        ...
        ValueError: feature 'item': id 9 is outside its table of 5 rows (ids run from 0 to 4)
        >>> check_inputs(torch.tensor([3, 960]), torch.tensor([1, 1]), ["user", "item"], torch.tensor([10, 960]),
        ...     [False, True])
        Traceback (most recent call last):
        ...
        ValueError: feature 'item': raw id 960 is outside its managed-collision id space of 960 ids (input_hash_size: raw ids run from 0 to 959)
    """
    num = len(features)
    if lengths.numel() % num != 0:
        raise ValueError(
            f"lengths has {lengths.numel()} entries; the artifact reads {num} features and takes one length per (feature, sample), "
            "feature-major"
        )
    if bool((lengths < 0).any()):
        raise ValueError("lengths holds a negative length")
    if max_lengths is not None:
        over = lengths.view(num, -1) > max_lengths.unsqueeze(1)
        if bool(over.any()):
            at = torch.nonzero(over)[0]
            f, s = int(at[0]), int(at[1])
            raise ValueError(
                f"feature '{features[f]}': sample {s} has {int(lengths.view(num, -1)[f, s])} ids, more than the "
                f"{int(max_lengths[f])} positions its position weights cover (max_feature_lengths)"
            )
    counts = lengths.view(num, -1).sum(1)
    total = int(counts.sum())
    if total != values.numel():
        raise ValueError(f"lengths add up to {total} ids, but values holds {values.numel()}")
    bad = (values < 0) | (values >= torch.repeat_interleave(rows, counts))
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        f = int((torch.cumsum(counts, 0) <= i).sum())
        n = int(rows[f])
        if raw_ids is not None and raw_ids[f]:
            raise ValueError(
                f"feature '{features[f]}': raw id {int(values[i])} is outside its managed-collision id space of {n} "
                f"ids (input_hash_size: raw ids run from 0 to {n - 1})"
            )
        raise ValueError(
            f"feature '{features[f]}': id {int(values[i])} is outside its table of {n} rows (ids run from 0 to {n - 1})"
        )
    return values


def assert_inputs(values: Tensor, lengths: Tensor, rows: Tensor, max_lengths: Tensor | None = None) -> Tensor:
    """:func:`check_inputs` as tensor assertions, for a graph ``torch.export`` captures: the same checks, but the
    message cannot name the feature or the id (they are tensor values, unknown when the graph is built). Compiled
    into a ``.pt2`` package, they raise in C++ too; :func:`lightning_rec.serving.load_pt2`'s host-side
    :func:`check_inputs` runs first in Python and names them. A ``lengths`` that is not one entry per (feature,
    sample) is refused by the package's shape check. Returns ``values``.
    """
    torch._assert_async((lengths >= 0).all(), "lightning_rec: lengths holds a negative length")
    if max_lengths is not None:  # a longer list would read past the position weights
        torch._assert_async(
            (lengths.view(rows.numel(), -1) <= max_lengths.unsqueeze(1)).all(),
            "lightning_rec: a sample has more ids than its feature's position weights cover (max_feature_lengths)",
        )
    counts = lengths.view(rows.numel(), -1).sum(1)
    torch._assert_async(counts.sum() == values.numel(), "lightning_rec: lengths do not add up to the ids in values")
    limit = torch.repeat_interleave(rows, counts, output_size=values.numel())
    torch._assert_async(
        ((values >= 0) & (values < limit)).all(),
        "lightning_rec: an id is outside its feature's table or managed-collision id space (load_pt2 in Python "
        "names the feature and the id)",
    )
    return values


class ServingWrapper(nn.Module):
    """Plain tensors in, the network's output out: builds the ``KeyedJaggedTensor`` the network takes, after
    :func:`check_inputs` when ``rows`` (the ids each feature takes: its table's rows, or a managed-collision table's
    ``input_hash_size``) is given (:func:`assert_inputs` when ``exported``: the graph ``torch.export`` captures for a
    ``.pt2`` package). The raw ids of managed-collision features are remapped to rows inside the network; a
    position-weighted feature takes no more ids a sample than its position weights cover."""

    rows: Tensor  # buffers
    max_lengths: Tensor

    def __init__(
        self,
        net: nn.Module,
        features: list[str],
        dense: bool,
        rows: list[int] | None = None,
        exported: bool = False,
        raw_id_features: Sequence[str] = (),
        max_lengths: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.features = features
        self.dense = dense
        self.check = rows is not None
        self.exported = exported
        self.raw_ids: list[bool] = [f in raw_id_features for f in features]  # for check_inputs' messages
        limits = dict(max_lengths or {})
        self.limited = bool(limits)
        self.register_buffer("rows", torch.tensor(rows or [], dtype=torch.long))
        no_limit = torch.iinfo(torch.long).max
        self.register_buffer("max_lengths", torch.tensor([limits.get(f, no_limit) for f in features], dtype=torch.long))

    def forward(self, dense_features: Tensor, values: Tensor, lengths: Tensor, weights: Tensor | None = None) -> Tensor:
        max_lengths = self.max_lengths if self.limited else None
        if self.check and self.exported:
            values = assert_inputs(values, lengths, self.rows, max_lengths)
        elif self.check:
            values = check_inputs(values, lengths, self.features, self.rows, self.raw_ids, max_lengths)
        sparse = KeyedJaggedTensor(keys=self.features, values=values, lengths=lengths, weights=weights)
        if self.dense:
            return self.net(dense_features, sparse)
        return self.net(sparse)


class SparseOnly(nn.Module):
    """The artifact's signature when the network reads no dense features (no ``dense_features`` argument)."""

    def __init__(self, serving: nn.Module) -> None:
        super().__init__()
        self.serving = serving

    def forward(self, values: Tensor, lengths: Tensor, weights: Tensor | None = None) -> Tensor:
        return self.serving(torch.empty(0), values, lengths, weights)


def inference_spec(path: str | Path) -> InferenceSpec:
    """The :class:`InferenceSpec` stored in the artifact at ``path`` (no model is loaded)."""
    extra = {SPEC_FILE: ""}
    torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    record = json.loads(extra[SPEC_FILE])
    check_version(record, path)
    return InferenceSpec(**record)


def serving_inputs(
    spec: InferenceSpec, sparse_features: KeyedJaggedTensor, dense_features: Tensor | None = None
) -> tuple[Tensor, ...]:
    """The artifact's arguments for a batch held as a ``KeyedJaggedTensor`` (and dense tensor): its features put in
    ``spec.features`` order, ``values``/``lengths`` (and ``weights`` if the artifact reads them) as plain tensors.

    Example::

        model, spec = load_inference("model.pt"), inference_spec("model.pt")
        probabilities = model(*serving_inputs(spec, batch.sparse_features, batch.dense_features))
    """
    missing = [f for f in spec.features if f not in sparse_features.keys()]
    if missing:
        raise ValueError(f"the batch lacks feature(s) {missing}; the artifact reads {spec.features}.")
    kjt = KeyedJaggedTensor.from_jt_dict({f: sparse_features[f] for f in spec.features})
    sparse: tuple[Tensor, ...] = (kjt.values(), kjt.lengths())
    if spec.weighted:
        sparse += (kjt.weights(),)
    if not spec.num_dense_features:
        return sparse
    if dense_features is None:
        raise ValueError(f"the artifact reads {spec.num_dense_features} dense features; pass `dense_features`.")
    return (dense_features, *sparse)


def load_inference(path: str | Path, map_location: str = "cpu", *, verify: bool = True) -> torch.jit.ScriptModule:
    """Load an artifact in Python (what any program does: ``import fbgemm_gpu`` then ``torch.jit.load``), after
    checking that it is the file export wrote (:func:`~lightning_rec.serving.verify`: each record's SHA-256;
    ``verify=False`` skips it).

    Raises:
        ServingError: the file was modified after export (naming the record), or carries no manifest.
    """
    import fbgemm_gpu  # noqa: F401  (registers the operators and classes the kernels use)

    if verify:
        verify_file(path)
    extra = {SPEC_FILE: ""}
    module = torch.jit.load(str(path), map_location=map_location, _extra_files=extra)
    if extra[SPEC_FILE]:  # an archive written by lightning_rec's export
        check_version(json.loads(extra[SPEC_FILE]), path)
    return module


def example_inputs(spec: InferenceSpec) -> tuple[Tensor | None, ...]:
    """Two samples, one id (row 0) per feature: the warm-up call's input."""
    rows = 2
    n = rows * len(spec.features)
    return (
        torch.zeros(rows, spec.num_dense_features),
        torch.zeros(n, dtype=torch.long),
        torch.ones(n, dtype=torch.int32),
        torch.ones(n) if spec.weighted else None,
    )
