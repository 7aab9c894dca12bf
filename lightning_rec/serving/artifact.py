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
    "as_floats",
    "as_ids",
    "assert_inputs",
    "check_dense",
    "check_inputs",
    "example_inputs",
    "inference_spec",
    "load_inference",
    "input_records",
    "serving_inputs",
    "warm_up",
    "warmup_inputs",
    "warmup_record",
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
        inputs: the artifact's arguments in order, each ``{"name", "dtype", "shape", "meaning"}`` (a shape's ``B``
            is the batch, ``N`` the ids, ``F`` the number of ``features``): the dtypes a ``.pt2`` package takes
            (any other is refused by name); ``None`` for artifacts written before it was recorded.
        output: what the artifact returns, ``{"meaning", "dtype", "shape"}``.
        warmup: a request and the output the artifact must give for it (``{"inputs": [...], "output": [...]}``, as
            nested lists in ``inputs``' order): a server's warm-up and health check (:func:`warm_up`).
        artifact_version: the version of this spec's layout (``ARTIFACT_VERSION``; 0: written before it was
            recorded); a loader refuses a newer one by name.
        checkpoint: the checkpoint it was exported from: ``{"step": global step, "id": the SHA-256 of its COMPLETE
            manifest}`` (one save, wherever it is copied); ``None`` for artifacts written before it was recorded.
        cpu: what a ``.pt2`` package's compiled code needs of the CPU, ``{"machine", "target", "features"}`` (the
            ``/proc/cpuinfo`` flags; see :mod:`lightning_rec.serving.cpu`); ``None`` for TorchScript (no compiled
            code) and for packages written before it was recorded.
        table_layout: ``.pt2`` only: where each table's rows lie in the package's constants, table name ->
            ``{"constant": its name (as the loader's get_constant_fqns() lists it), "rows", "dim", "dtype", "offset":
            the byte offset of row 0, "row_bytes": the bytes from one row to the next}``: a row's bytes are
            :func:`~lightning_rec.serving.deltas.artifact_rows`' (see :mod:`lightning_rec.serving.layout`); ``None``
            for TorchScript and for packages written before it was recorded (they cannot follow deltas).
        constant_sources: ``.pt2`` only: package constant -> the training ``state_dict`` key of the parameter or
            buffer it is; the constants not listed never change. ``None`` as for ``table_layout``.
        fixed_sources: ``.pt2`` only: the training ``state_dict`` keys the package reads as anonymous constants
            (TorchRec's position weights, held in a plain dict), which no update can reach: a server refuses to
            follow deltas with such a package (:class:`~lightning_rec.serving.FreshModel`). ``None`` as above.
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
    inputs: list[dict[str, Any]] | None = None  # artifacts written before these were recorded: unknown
    output: dict[str, Any] | None = None
    warmup: dict[str, Any] | None = None
    artifact_version: int = 0  # artifacts written before it was recorded
    checkpoint: dict[str, Any] | None = None
    cpu: dict[str, Any] | None = None
    table_layout: dict[str, dict[str, Any]] | None = None  # .pt2 packages written since issue 47
    constant_sources: dict[str, str] | None = None
    fixed_sources: list[str] | None = None


@torch.fx.wrap  # a leaf of the fx trace (it branches on values), compiled by TorchScript into the artifact
def check_inputs(
    values: Tensor,
    lengths: Tensor,
    features: list[str],
    rows: Tensor,
    raw_ids: list[bool] | None = None,
    max_lengths: Tensor | None = None,
    check_ids: bool = True,
) -> Tensor:
    """Raise a ``ValueError`` naming the problem when ``values``/``lengths`` do not fit the artifact: a ``lengths``
    that is not one entry per (feature, sample), a negative length, a sample with more ids than its feature may bring
    (``max_lengths``, per feature, when given: position weights, a sequence model's ``max_len``), lengths that do not
    add up to ``values``, or
    an id outside its feature's table (``rows``: the table's rows per feature; for a feature whose ``raw_ids`` entry
    is true, a managed-collision table's, the raw id space its collision module remaps: ``input_hash_size``; not with
    ``check_ids=False``). Returns ``values``.

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
                f"{int(max_lengths[f])} it may bring (max_lengths: the positions its position weights cover, or a "
                "sequence model's max_len)"
            )
    counts = lengths.view(num, -1).sum(1)
    total = int(counts.sum())
    if total != values.numel():
        raise ValueError(f"lengths add up to {total} ids, but values holds {values.numel()}")
    if not check_ids:
        return values
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


@torch.fx.wrap  # a leaf of the fx trace (it branches on the dtype), compiled by TorchScript into the artifact
def as_ids(ids: Tensor, name: str) -> Tensor:
    """``ids`` (``values`` or ``lengths``) as int64, whatever their integer dtype; a ``ValueError`` naming the
    argument for any other dtype (a float id is not an id).

    Example::

        >>> as_ids(torch.tensor([1, 2], dtype=torch.int16), "values").dtype
        torch.int64
        >>> as_ids(torch.tensor([1.5]), "values")
        Traceback (most recent call last):
        ...
        ValueError: values holds floating-point numbers; the artifact takes integers (int64, or any integer dtype: converted)
    """
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        kind = "bool" if ids.dtype == torch.bool else ("complex" if ids.is_complex() else "floating-point")
        raise ValueError(
            f"{name} holds {kind} numbers; the artifact takes integers (int64, or any integer dtype: converted)"
        )
    return ids.long()


@torch.fx.wrap  # a leaf of the fx trace (it reads an optional tensor), compiled by TorchScript into the artifact
def as_floats(values: Tensor | None) -> Tensor | None:
    """``values`` (``dense_features``, ``weights``) as float32, or ``None``."""
    if values is None:
        return None
    return values.float()


@torch.fx.wrap  # a leaf of the fx trace (it branches on shapes), compiled by TorchScript into the artifact
def check_dense(dense_features: Tensor, lengths: Tensor, num_features: int, width: int) -> Tensor:
    """Raise a ``ValueError`` unless ``dense_features`` is ``[B, width]`` for the ``B`` samples of ``lengths`` (one
    length per (feature, sample) of ``num_features`` features). Returns ``dense_features``.

    Example::

        >>> check_dense(torch.zeros(2, 4), torch.ones(6), 3, 3)
        Traceback (most recent call last):
        ...
        ValueError: dense_features has shape [2, 4]; lengths holds 2 samples of 3 features, so the artifact expects [2, 3]
    """
    batch = lengths.numel() // num_features
    if dense_features.dim() != 2 or dense_features.shape[0] != batch or dense_features.shape[1] != width:
        raise ValueError(
            f"dense_features has shape {list(dense_features.shape)}; lengths holds {batch} samples of "
            f"{num_features} features, so the artifact expects [{batch}, {width}]"
        )
    return dense_features


def assert_inputs(
    values: Tensor,
    lengths: Tensor,
    rows: Tensor,
    batch: int,
    max_lengths: Tensor | None = None,
    check_ids: bool = True,
) -> tuple[Tensor, Tensor]:
    """:func:`check_inputs` as tensor assertions, for a graph ``torch.export`` captures: the same checks, but the
    message cannot name the feature or the id (they are tensor values, unknown when the graph is built). Compiled
    into a ``.pt2`` package, they raise in C++ too (a ``std::runtime_error``, ``RuntimeError`` in Python);
    :func:`lightning_rec.serving.load_pt2` runs :func:`check_inputs` in Python after they refused a request, to name them.

    ``lengths`` is a graph input of its own size (not derived from the batch, which the compiled code would take on
    trust and read past a shorter tensor): it must hold ``F x batch`` entries, checked here, and what the network
    reads is a copy of exactly that many (zeros past a shorter one), so no read leaves the caller's tensor.

    Returns:
        ``(values, lengths)``, ``lengths`` of exactly ``F x batch`` entries.
    """
    num = rows.numel()
    size = num * batch
    torch._assert_async(
        torch.scalar_tensor(lengths.shape[0], dtype=torch.long) == size,
        "lightning_rec: lengths must hold one length per (feature, sample), feature-major: F x B entries for the "
        "artifact's F features (its spec's 'features') and the B samples of dense_features",
    )
    lengths = torch.cat([lengths, lengths.new_zeros(size)])[:size]
    torch._assert_async((lengths >= 0).all(), "lightning_rec: lengths holds a negative length")
    if max_lengths is not None:  # a longer list would read past the position weights, or a sequence's positions
        torch._assert_async(
            (lengths.view(num, -1) <= max_lengths.unsqueeze(1)).all(),
            "lightning_rec: a sample has more ids than its feature may bring (the spec's max_lengths: position "
            "weights, a sequence model's max_len)",
        )
    counts = lengths.view(num, -1).sum(1)
    torch._assert_async(counts.sum() == values.numel(), "lightning_rec: lengths do not add up to the ids in values")
    if not check_ids:
        return values, lengths
    limit = torch.repeat_interleave(rows, counts, output_size=values.numel())
    torch._assert_async(
        ((values >= 0) & (values < limit)).all(),
        "lightning_rec: an id is outside its feature's table or managed-collision id space (load_pt2 in Python "
        "names the feature and the id)",
    )
    return values, lengths


class ServingWrapper(nn.Module):
    """Plain tensors in, the network's output out: builds the ``KeyedJaggedTensor`` the network takes, after
    :func:`check_inputs` when ``rows`` (the ids each feature takes: its table's rows, or a managed-collision table's
    ``input_hash_size``) is given (:func:`assert_inputs` when ``exported``: the graph ``torch.export`` captures for a
    ``.pt2`` package): the lengths always, the ids unless ``check_ids`` is false (``bounds_check`` ``warn``,
    ``ignore``, ``none``: FBGEMM's kernels then do what the policy says). The raw ids of managed-collision features are remapped to rows inside the network; a feature
    with a limit (``max_lengths``: position weights, a sequence model's ``max_len``) takes no more ids a sample.

    The caller's tensors are never written to: FBGEMM's kernels, under ``bounds_check`` ``warn``/``ignore``
    (``copy_values``), set a too large id to 0 in the tensor they are given, so they are given a copy.

    Args:
        net: the serving network.
        features: the features the artifact takes, in the order of ``lengths``.
        dense: whether the network reads dense features.
        rows: the ids each feature in ``features`` takes (``None``: no input check).
        check_ids: check each id against ``rows`` (else only the lengths and the dense shape).
        exported: the ``.pt2`` graph (:func:`assert_inputs`) rather than TorchScript (:func:`check_inputs`).
        raw_id_features: the managed-collision features.
        max_lengths: feature -> the most ids a sample may bring.
        num_dense: the dense width (checked by TorchScript's wrapper; a ``.pt2`` package checks its static shape).
        network_features: every feature of the network's collections, in the order its ``KeyedJaggedTensor``
            takes them (default ``features``); those the artifact does not take are passed empty.
        copy_values: give the network a copy of ``values`` (FBGEMM's ``warn``/``ignore`` bounds checks rewrite it).
    """

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
        num_dense: int | None = None,
        network_features: Sequence[str] | None = None,
        copy_values: bool = False,
        check_ids: bool = True,
    ) -> None:
        super().__init__()
        self.net = net
        self.features = features
        self.dense = dense
        self.check = rows is not None
        self.exported = exported
        self.num_dense = num_dense
        self.copy_values = copy_values
        self.check_ids = check_ids
        self.raw_ids: list[bool] = [f in raw_id_features for f in features]  # for check_inputs' messages
        self.network_features = list(network_features or features)
        # where each network feature's lengths come from: its row in `lengths`, or -1 (passed empty)
        self.slots = [features.index(f) if f in features else -1 for f in self.network_features]
        limits = dict(max_lengths or {})
        self.limited = bool(limits)
        self.register_buffer("rows", torch.tensor(rows or [], dtype=torch.long))
        no_limit = torch.iinfo(torch.long).max
        self.register_buffer("max_lengths", torch.tensor([limits.get(f, no_limit) for f in features], dtype=torch.long))

    def forward(self, dense_features: Tensor, values: Tensor, lengths: Tensor, weights: Tensor | None = None) -> Tensor:
        max_lengths = self.max_lengths if self.limited else None
        num = len(self.features)
        batch = dense_features.shape[0] if self.dense else lengths.shape[0] // num
        if not self.exported:  # TorchScript takes any integer ids and lengths, any float values (a .pt2 refuses them)
            values, lengths, weights = as_ids(values, "values"), as_ids(lengths, "lengths"), as_floats(weights)
            if self.dense:
                dense_features = dense_features.float()
        if self.check and self.exported:
            values, lengths = assert_inputs(values, lengths, self.rows, batch, max_lengths, self.check_ids)
        elif self.check:
            values = check_inputs(values, lengths, self.features, self.rows, self.raw_ids, max_lengths, self.check_ids)
        if self.dense and self.num_dense is not None and not self.exported:
            dense_features = check_dense(dense_features, lengths, num, self.num_dense)
        if self.copy_values:
            values = values.clone()
        if self.slots != list(range(num)):
            lengths = self._network_lengths(lengths, batch)
        sparse = KeyedJaggedTensor(keys=self.network_features, values=values, lengths=lengths, weights=weights)
        if self.dense:
            return self.net(dense_features, sparse)
        return self.net(sparse)

    def _network_lengths(self, lengths: Tensor, batch: int) -> Tensor:
        """The lengths of every network feature: the artifact's features' own, zeros for the others."""
        per_feature = lengths.view(len(self.features), batch)
        empty = lengths.new_zeros(batch)
        return torch.cat([per_feature[slot] if slot >= 0 else empty for slot in self.slots])


class SparseOnly(nn.Module):
    """The artifact's signature when the network reads no dense features (no ``dense_features`` argument)."""

    def __init__(self, serving: nn.Module) -> None:
        super().__init__()
        self.serving = serving

    def forward(self, values: Tensor, lengths: Tensor, weights: Tensor | None = None) -> Tensor:
        return self.serving(torch.empty(0), values, lengths, weights)


def input_records(num_dense_features: int, num_features: int, weighted: bool) -> list[dict[str, Any]]:
    """The artifact's arguments, in order, as its spec lists them (``inputs``).

    Example::

        >>> [(r["name"], r["dtype"], r["shape"]) for r in input_records(0, 2, False)]
        [('values', 'int64', ['N']), ('lengths', 'int64', ['2*B'])]
    """
    records: list[dict[str, Any]] = []
    if num_dense_features:
        records.append(
            {"name": "dense_features", "dtype": "float32", "shape": ["B", num_dense_features],
             "meaning": "each sample's dense features"}
        )  # fmt: skip
    records.append({"name": "values", "dtype": "int64", "shape": ["N"], "meaning": "every id, feature by feature"})
    records.append(
        {"name": "lengths", "dtype": "int64", "shape": [f"{num_features}*B" if num_features > 1 else "B"],
         "meaning": "ids per (feature, sample), feature-major, in the order of 'features'"}
    )  # fmt: skip
    if weighted:
        records.append({"name": "weights", "dtype": "float32", "shape": ["N"], "meaning": "each id's weight"})
    return records


def warm_up(model: Any, spec: InferenceSpec, atol: float = 1e-5) -> Tensor:
    """Call a loaded artifact (``load_pt2``, ``aoti_load_package``, ``torch.jit.load``) on the request its spec
    records (``warmup``) and check that it gives the recorded output: a server's first call (it pays the one-time
    costs) and its health check. Returns the output.

    Raises:
        ServingError: the spec records no warm-up request (written before it was recorded), or the artifact gives
            another output (a damaged file, another machine's arithmetic, an unsupported build).

    Example::

        model = load_pt2("model_int8.pt2")
        warm_up(model, model.spec)
    """
    from lightning_rec.errors import ServingError

    if spec.warmup is None or spec.inputs is None:
        raise ServingError("the artifact's spec records no warm-up request (exported before it was recorded)")
    args = [torch.tensor(v, dtype=getattr(torch, r["dtype"])) for v, r in zip(spec.warmup["inputs"], spec.inputs)]
    with torch.inference_mode():
        got = model(*args)
    want = torch.tensor(spec.warmup["output"], dtype=got.dtype)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=0, atol=atol):
        worst = float((got - want).abs().max()) if got.shape == want.shape else float("nan")
        raise ServingError(
            f"the artifact's warm-up request gave another output than at export (shape {list(got.shape)} vs "
            f"{list(want.shape)}, largest difference {worst:.3g}): do not serve it"
        )
    return got


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
    ``spec.features`` order, ``values``/``lengths`` (and ``weights`` if the artifact reads them) as plain tensors, in
    the dtypes the spec's ``inputs`` list (int64 ids and lengths, float32 dense features and weights).

    Example::

        model, spec = load_inference("model.pt"), inference_spec("model.pt")
        probabilities = model(*serving_inputs(spec, batch.sparse_features, batch.dense_features))
    """
    missing = [f for f in spec.features if f not in sparse_features.keys()]
    if missing:
        raise ValueError(f"the batch lacks feature(s) {missing}; the artifact reads {spec.features}.")
    kjt = KeyedJaggedTensor.from_jt_dict({f: sparse_features[f] for f in spec.features})
    sparse: tuple[Tensor, ...] = (kjt.values().long(), kjt.lengths().long())  # the dtypes a .pt2 package takes
    if spec.weighted:
        sparse += (kjt.weights().float(),)
    if not spec.num_dense_features:
        return sparse
    if dense_features is None:
        raise ValueError(f"the artifact reads {spec.num_dense_features} dense features; pass `dense_features`.")
    return (dense_features.float(), *sparse)


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
        torch.ones(n, dtype=torch.long),
        torch.ones(n) if spec.weighted else None,
    )


def warmup_record(spec: InferenceSpec, served: nn.Module) -> dict[str, Any]:
    """The spec's ``warmup``: :func:`warmup_inputs` (those the artifact takes) and what ``served`` (the eager
    network the artifact is made of) answers to them."""
    dense, values, lengths, weights = warmup_inputs(spec)
    assert dense is not None and values is not None and lengths is not None
    args = [dense] if spec.num_dense_features else []
    args += [values, lengths] + ([weights] if spec.weighted and weights is not None else [])
    with torch.no_grad():
        output = served(*args)
    return {"inputs": [a.tolist() for a in args], "output": output.tolist()}


def warmup_inputs(spec: InferenceSpec, batch: int = 3) -> tuple[Tensor | None, ...]:
    """``(dense_features, values, lengths, weights)`` of the spec's warm-up request: ``batch`` samples with 0 to 3
    ids per feature (at most its ``max_lengths``), drawn over each feature's whole table (seeded, so the same for
    every export), so that a damaged table or another arithmetic shows in the output."""
    g = torch.Generator().manual_seed(45)
    most = torch.tensor([min(3, spec.max_lengths.get(f, 3)) for f in spec.features]).repeat_interleave(batch)
    lengths = (torch.rand(len(spec.features) * batch, generator=g) * (most + 1)).long()
    rows = torch.tensor(spec.feature_rows or [1] * len(spec.features)).repeat_interleave(batch)
    values = (torch.rand(int(lengths.sum()), generator=g) * rows.repeat_interleave(lengths)).long()
    return (
        torch.randn(batch, spec.num_dense_features, generator=g),
        values,
        lengths,
        torch.rand(values.numel(), generator=g) if spec.weighted else None,
    )
