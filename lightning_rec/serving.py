"""From a sharded checkpoint to a model that serves: a quantized TorchScript artifact that loads without this
package (only ``torch`` and FBGEMM's operators), in Python or C++.

:func:`export_inference` loads the checkpoint unsharded (saved at any world size, with any plan), asks the module
for the network that serves (:meth:`~lightning_rec.RecLightningModule.inference_module`), swaps every
``EmbeddingBagCollection``/``EmbeddingCollection`` for TorchRec's quantized inference module with tables in the
chosen dtype (FBGEMM's ``IntNBitTableBatchedEmbeddingBagsCodegen`` kernels), traces it with TorchRec's ``fx``
tracer (the kernels stay leaves), compiles it with TorchScript and saves it, with a JSON description of its inputs
(``extra/lightning_rec.json`` in the archive). TorchRec's own recipe (``torchrec/inference/dlrm_predict.py``).

Why TorchScript rather than ``torch.export``: the quantized kernels hold a ``torch.classes.fbgemm.AtomicCounter``
that has no fake implementation, so ``torch.export`` refuses them (torch 2.13, FBGEMM 1.8); TorchScript saves the
``KeyedJaggedTensor`` code into the archive, so loading needs neither TorchRec nor this package, and libtorch loads
it from C++.

The artifact takes plain tensors, one sample per row::

    forward(dense_features: Tensor[B, D],          # only if the served network reads dense features
            values: Tensor[N] (int64 or int32),     # every id, feature by feature (feature-major, as a KJT)
            lengths: Tensor[F * B] (int),           # ids per (feature, sample), feature-major
            weights: Optional[Tensor[N]] = None)    # per-id weights, for weighted collections
        -> Tensor                                  # what the network returns (CTR models: probabilities [B])

The feature order ``F`` is fixed at export and written in ``extra/lightning_rec.json`` (``"features"``).

Example::

    export_inference("checkpoints/last.ckpt", "model_int8.pt", table_dtype="int8")

    # anywhere, without lightning_rec or torchrec:
    import torch, fbgemm_gpu                        # fbgemm_gpu registers the kernels' operators
    model = torch.jit.load("model_int8.pt")
    with torch.inference_mode():
        probabilities = model(dense, values, lengths)
"""

# No `from __future__ import annotations` here: torch.fx and TorchScript read the forwards' annotations as types.
import copy
import importlib
import inspect
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import Tensor, nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec.config import BoundsCheck
from lightning_rec.errors import ExportError
from lightning_rec.tables import embedding_modules

__all__ = [
    "InferenceSpec",
    "TableDtype",
    "check_inputs",
    "export_inference",
    "inference_spec",
    "load_inference",
    "serving_inputs",
]

TableDtype = Literal["fp32", "fp16", "int8", "int4"]
_DTYPES: Dict[str, torch.dtype] = {
    "fp32": torch.float,
    "fp16": torch.half,
    "int8": torch.qint8,
    "int4": torch.quint4x2,
}
# The training strategy's policy names for FBGEMM's modes (an id outside its table).
_BOUNDS_CHECK = {
    "error": BoundsCheckMode.FATAL,
    "warn": BoundsCheckMode.WARNING,
    "ignore": BoundsCheckMode.IGNORE,
    "none": BoundsCheckMode.NONE,
}
SPEC_FILE = "lightning_rec.json"
_KERNELS = ["IntNBitTableBatchedEmbeddingBagsCodegen"]  # FBGEMM's inference kernels: leaves of the fx trace


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
    """

    features: List[str]
    num_dense_features: int
    weighted: bool
    table_dtype: str
    tables: Dict[str, List[int]]
    model: str
    part: Optional[str] = None
    bounds_check: str = "warn"  # artifacts written before the policy was recorded: FBGEMM's default


@torch.fx.wrap  # a leaf of the fx trace (it branches on values), compiled by TorchScript into the artifact
def check_inputs(values: Tensor, lengths: Tensor, features: List[str], rows: Tensor) -> Tensor:
    """Raise a ``ValueError`` naming the problem when ``values``/``lengths`` do not fit the artifact: a ``lengths``
    that is not one entry per (feature, sample), lengths that do not add up to ``values``, or an id outside its
    feature's table (``rows``: the table's rows per feature). Returns ``values``.

    Example::

        >>> check_inputs(torch.tensor([3, 9]), torch.tensor([1, 1]), ["user", "item"], torch.tensor([10, 5]))
        Traceback (most recent call last):
        ...
        ValueError: feature 'item': id 9 is outside its table of 5 rows (ids run from 0 to 4)
    """
    num = len(features)
    if lengths.numel() % num != 0:
        raise ValueError(
            "lengths has {} entries; the artifact reads {} features and takes one length per (feature, sample), "
            "feature-major".format(lengths.numel(), num)
        )
    counts = lengths.view(num, -1).sum(1)
    total = int(counts.sum())
    if total != values.numel():
        raise ValueError("lengths add up to {} ids, but values holds {}".format(total, values.numel()))
    bad = (values < 0) | (values >= torch.repeat_interleave(rows, counts))
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        f = int((torch.cumsum(counts, 0) <= i).sum())
        n = int(rows[f])
        raise ValueError(
            "feature '{}': id {} is outside its table of {} rows (ids run from 0 to {})".format(
                features[f], int(values[i]), n, n - 1
            )
        )
    return values


class _Serving(nn.Module):
    """Plain tensors in, the network's output out: builds the ``KeyedJaggedTensor`` the network takes, after
    :func:`check_inputs` when ``rows`` (the table rows of each feature) is given."""

    def __init__(self, net: nn.Module, features: List[str], dense: bool, rows: Optional[List[int]] = None) -> None:
        super().__init__()
        self.net = net
        self.features = features
        self.dense = dense
        self.check = rows is not None
        self.register_buffer("rows", torch.tensor(rows or [], dtype=torch.long))

    def forward(
        self, dense_features: Tensor, values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None
    ) -> Tensor:
        if self.check:
            values = check_inputs(values, lengths, self.features, self.rows)
        sparse = KeyedJaggedTensor(keys=self.features, values=values, lengths=lengths, weights=weights)
        if self.dense:
            return self.net(dense_features, sparse)
        return self.net(sparse)


class _SparseOnly(nn.Module):
    """The artifact's signature when the network reads no dense features (no ``dense_features`` argument)."""

    def __init__(self, serving: nn.Module) -> None:
        super().__init__()
        self.serving = serving

    def forward(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None) -> Tensor:
        return self.serving(torch.empty(0), values, lengths, weights)


def inference_spec(path: Union[str, Path]) -> InferenceSpec:
    """The :class:`InferenceSpec` stored in the artifact at ``path`` (no model is loaded)."""
    extra = {SPEC_FILE: ""}
    torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    return InferenceSpec(**json.loads(extra[SPEC_FILE]))


def serving_inputs(
    spec: InferenceSpec, sparse_features: KeyedJaggedTensor, dense_features: Optional[Tensor] = None
) -> Tuple[Tensor, ...]:
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
    sparse: Tuple[Tensor, ...] = (kjt.values(), kjt.lengths())
    if spec.weighted:
        sparse += (kjt.weights(),)
    if not spec.num_dense_features:
        return sparse
    if dense_features is None:
        raise ValueError(f"the artifact reads {spec.num_dense_features} dense features; pass `dense_features`.")
    return (dense_features, *sparse)


def load_inference(path: Union[str, Path], map_location: str = "cpu") -> torch.jit.ScriptModule:
    """Load an artifact in Python (what any program does: ``import fbgemm_gpu`` then ``torch.jit.load``)."""
    import fbgemm_gpu  # noqa: F401  (registers the operators and classes the kernels use)

    return torch.jit.load(str(path), map_location=map_location)


def export_inference(
    checkpoint: Union[str, Path],
    output: Union[str, Path],
    *,
    table_dtype: TableDtype = "int8",
    part: Optional[str] = None,
    model_class: Optional[Union[str, type]] = None,
    num_dense_features: Optional[int] = None,
    weights_only: Optional[bool] = None,
    init_args: Optional[Dict[str, Any]] = None,
    bounds_check: BoundsCheck = "error",
) -> InferenceSpec:
    """Write the serving network of a sharded checkpoint as a quantized TorchScript artifact (one process, CPU).

    Args:
        checkpoint: a checkpoint directory written on any number of ranks with any plan.
        output: the artifact's path (written to a temporary name, then renamed; an existing file is replaced only
            once the new one is complete).
        table_dtype: the tables' storage: ``"fp32"`` (the trained rows, bit for bit), ``"fp16"``, ``"int8"`` or
            ``"int4"`` (row-wise quantized, with a per-row scale and bias). The dense layers stay fp32.
        part: which network to export, for modules that serve more than one (the two-tower model's ``"query"`` or
            ``"candidate"`` tower; see the module's ``inference_module``).
        model_class: the LightningModule class (or ``"package.module.Class"``); default: the one the checkpoint
            was saved from.
        num_dense_features: the width of the dense input; default: the module's ``num_dense_features``
            hyperparameter.
        weights_only: ``False`` lets the checkpoint's ``meta.pt`` unpickle arbitrary objects (trusted only).
        init_args: arguments of the module's ``__init__`` the checkpoint did not save (no
            ``save_hyperparameters()``), or that override saved ones, as for ``load_from_checkpoint``.
        bounds_check: what the artifact does with an id outside its table: ``"error"`` (:func:`check_inputs` raises
            a ``ValueError`` naming the feature, the id and the table's rows, and refuses malformed ``lengths``;
            FBGEMM's ``BoundsCheckMode.FATAL`` behind it), ``"warn"``/``"ignore"`` (a too large id reads row 0,
            FBGEMM's default for inference kernels), ``"none"`` (no check). As the training strategy's
            ``bounds_check``.

    Returns:
        the artifact's :class:`InferenceSpec`.

    Raises:
        ExportError: naming the part of the model that cannot be exported and why; nothing is written then.
        CheckpointError: the checkpoint is incomplete, corrupt or does not match the module.

    Example::

        spec = export_inference("checkpoints/last.ckpt", "query_tower.pt", part="query", table_dtype="fp16")
        spec.features           # ['user_id', 'history', ...]: the order of `lengths`
    """
    from torchrec.inference.modules import quantize_inference_model

    from lightning_rec.checkpoint import layout, load_module, safe_io

    if table_dtype not in _DTYPES:
        raise ExportError(f"table_dtype must be one of {sorted(_DTYPES)}, got {table_dtype!r}.")
    if bounds_check not in _BOUNDS_CHECK:
        raise ExportError(f"bounds_check must be one of {list(_BOUNDS_CHECK)}, got {bounds_check!r}.")
    path = layout.recover(Path(checkpoint))
    cls = _model_class(model_class, safe_io.load_meta(path / layout.META_FILE, weights_only), path)
    module = load_module(cls, path, weights_only=weights_only, **(init_args or {})).eval()
    net = _serving_network(module, part)
    collections = embedding_modules(net)
    feature_rows, weighted, tables = _features(net, collections)
    features = list(feature_rows)
    _check_row_width(tables, table_dtype, type(net).__name__)
    dense = _takes_dense(net)
    if dense:
        num_dense_features = _num_dense(module, num_dense_features, net, features, weighted)
    spec = InferenceSpec(
        features=features,
        num_dense_features=num_dense_features if dense else 0,
        weighted=weighted,
        table_dtype=table_dtype,
        tables=tables,
        model=f"{cls.__module__}.{cls.__qualname__}",
        part=part,
        bounds_check=bounds_check,
    )
    rows = list(feature_rows.values()) if bounds_check == "error" else None
    serving = _Serving(copy.deepcopy(net), features, dense, rows).eval()
    quantized = quantize_inference_model(serving, quantization_dtype=_DTYPES[table_dtype])
    for kernel in quantized.modules():
        if type(kernel).__name__ in _KERNELS:  # TorchScript keeps the attribute: the artifact checks its ids
            kernel.bounds_check_mode_int = _BOUNDS_CHECK[bounds_check].value
    example = _example(spec)
    try:
        with torch.no_grad():
            quantized(*example)  # TorchRec caches the feature order on the first call: it must not be the trace's
    except Exception as err:
        raise ExportError(_call_failed(module, net, dense, err)) from err
    scripted = _script(_SparseOnly(quantized) if not dense else quantized, type(net).__name__)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    scripted.save(str(partial), _extra_files={SPEC_FILE: json.dumps(asdict(spec))})
    os.replace(partial, output)
    return spec


def _model_class(model_class: Optional[Union[str, type]], meta: Dict[str, Any], path: Path) -> type:
    name = model_class or meta.get("lightning_rec", {}).get("module_class")
    if name is None:
        raise ExportError(
            f"{str(path)!r} does not name the LightningModule it was saved from (checkpoints written before "
            "lightning_rec recorded it). HINT: pass `model_class=` (`--model-class package.module.Class`)."
        )
    if isinstance(name, type):
        return name
    module_name, _, qualname = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), qualname)
    except (ImportError, AttributeError, ValueError) as err:
        hint = "pass `model_class=` (`--model-class package.module.Class`)"
        if module_name == "__main__":  # saved by a script: its module name is only known to the user
            hint = (
                f"{qualname} was defined in the script that trained it; pass `model_class=` (`--model-class "
                f'script.{qualname}` from the script\'s folder, its training guarded by `if __name__ == "__main__":`)'
            )
        raise ExportError(f"cannot import the model class {name!r}: {err}. HINT: {hint}.") from None


def _serving_network(module: nn.Module, part: Optional[str]) -> nn.Module:
    hook = getattr(module, "inference_module", None)
    name = type(module).__name__
    if hook is None:
        raise ExportError(
            f"{name} cannot be exported: it defines no `inference_module()`. HINT: subclass RecLightningModule and "
            "return the nn.Module that serves, taking `(dense_features: Tensor, sparse_features: KeyedJaggedTensor)` "
            "or `(sparse_features: KeyedJaggedTensor)`."
        )
    net = hook(part) if part is not None else hook()
    if not isinstance(net, nn.Module):
        raise ExportError(f"{name}.inference_module() returned {type(net).__name__}, not an nn.Module.")
    if not embedding_modules(net):
        raise ExportError(
            f"{name}.inference_module() returned {type(net).__name__}, which holds no EmbeddingBagCollection or "
            "EmbeddingCollection: there are no tables to serve."
        )
    return net


def _features(net: nn.Module, collections: Dict[str, nn.Module]) -> Tuple[Dict[str, int], bool, Dict[str, List[int]]]:
    """Every feature the network's collections read (first-seen order) with its table's rows, whether any pools with
    weights, and the tables' shapes."""
    features: Dict[str, int] = {}
    tables: Dict[str, List[int]] = {}
    weighted = False
    for path, sub in collections.items():
        if isinstance(sub, EmbeddingBagCollection):
            configs, weighted = sub.embedding_bag_configs(), weighted or bool(sub.is_weighted())
        elif isinstance(sub, EmbeddingCollection):
            configs = sub.embedding_configs()
        else:  # pragma: no cover - embedding_modules finds only these two
            raise ExportError(f"{type(net).__name__}.{path}: {type(sub).__name__} has no quantized inference module.")
        for config in configs:
            features.update(dict.fromkeys(config.feature_names, int(config.num_embeddings)))
            tables[config.name] = [int(config.num_embeddings), int(config.embedding_dim)]
    return features, weighted, tables


# FBGEMM packs a quantized row in 2-byte units (ncols x bits must be a multiple of 16).
_ROW_MULTIPLE = {"int8": 2, "int4": 4}


def _check_row_width(tables: Dict[str, List[int]], table_dtype: str, name: str) -> None:
    multiple = _ROW_MULTIPLE.get(table_dtype)
    odd = {t: dim for t, (_, dim) in tables.items() if multiple and dim % multiple}
    if odd:
        fits = [d for d, m in _ROW_MULTIPLE.items() if all(dim % m == 0 for dim in odd.values())]
        raise ExportError(
            f"{name}: table(s) {', '.join(f'{t} (embedding_dim {d})' for t, d in odd.items())} cannot be stored as "
            f"{table_dtype}: FBGEMM's {table_dtype} rows need an embedding_dim that is a multiple of {multiple}. "
            f"HINT: --table-dtype {' or '.join(fits + ['fp16', 'fp32'])}."
        )


def _call_failed(module: nn.Module, net: nn.Module, dense: bool, err: Exception) -> str:
    """Why the served network could not be called on a ``KeyedJaggedTensor`` (and a dense tensor), and what to do."""
    call = "forward(dense_features, sparse_features: KeyedJaggedTensor)" if dense else "forward(sparse_features)"
    hint = (
        f"override `{type(module).__name__}.inference_module()` to return the nn.Module that serves, taking "
        "`(dense_features, sparse_features: KeyedJaggedTensor)` or `(sparse_features: KeyedJaggedTensor)`"
        if net is module
        else f"the module `inference_module()` returns must take {call}"
    )
    return (
        f"{type(net).__name__} cannot be served as {call}: calling it on a KeyedJaggedTensor"
        f"{' and a dense tensor' if dense else ''} of two samples raised {type(err).__name__}: {err}. HINT: {hint}."
    )


def _takes_dense(net: nn.Module) -> bool:
    params = [p for p in inspect.signature(net.forward).parameters.values() if p.default is inspect.Parameter.empty]
    if len(params) not in (1, 2):
        names = ", ".join(p.name for p in params)
        raise ExportError(
            f"{type(net).__name__}.forward({names}) cannot be served: it must take `(sparse_features)` or "
            "`(dense_features, sparse_features)`, a KeyedJaggedTensor and a dense tensor."
        )
    if len(params) == 2 and "KeyedJaggedTensor" in str(params[0].annotation):
        raise ExportError(
            f"{type(net).__name__}.forward({params[0].name}, {params[1].name}) takes the KeyedJaggedTensor first; "
            "the artifact calls forward(dense_features, sparse_features). HINT: swap the arguments, or return a "
            "module that takes them in that order from `inference_module()`."
        )
    return len(params) == 2


def _num_dense(module: nn.Module, given: Optional[int], net: nn.Module, features: List[str], weighted: bool) -> int:
    """The dense input's width: given, the module's ``num_dense_features`` hyperparameter, or read from the first
    layer the dense input reaches (see :func:`_dense_width`)."""
    width = given if given is not None else getattr(module, "hparams", {}).get("num_dense_features")
    if width is None:
        width = _dense_width(net, features, weighted)
    if not isinstance(width, int) or width < 0:
        raise ExportError(
            f"{type(module).__name__}: the served network reads dense features, but their number is unknown (no "
            "`num_dense_features` hyperparameter, and no Linear, BatchNorm1d or LayerNorm the dense input reaches "
            "tells it). HINT: pass `num_dense_features=` (`--num-dense-features`); if its forward takes the "
            "KeyedJaggedTensor first, swap the arguments: the artifact calls forward(dense_features, sparse_features)."
        )
    return width


def _input_width(module: nn.Module) -> Optional[int]:
    """The last-dimension width a layer takes, for the layers a dense input meets first."""
    if isinstance(module, nn.Linear):
        return module.in_features
    if isinstance(module, nn.BatchNorm1d):
        return module.num_features
    if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1:
        return module.normalized_shape[0]
    return None


class _WidthFound(Exception):
    def __init__(self, width: int) -> None:
        self.width = width


def _dense_width(net: nn.Module, features: List[str], weighted: bool) -> Optional[int]:
    """The dense width the first ``nn.Linear`` (or ``BatchNorm1d``, ``LayerNorm``) on the dense input's path implies:
    the network is run (``torch.fx`` interpreter, on a copy) with a dense input of width 0, and the width that layer
    takes minus the width it then receives is the dense width, whether the dense input reaches it alone
    (``bottom(dense)``) or concatenated with other columns (``over(cat([kt.values(), dense], 1))``). The answer is
    checked by running the network with it."""
    from torchrec.fx import Tracer

    serving = _Serving(copy.deepcopy(net), features, dense=True)  # a copy: running it fills TorchRec's caches
    try:
        graph = Tracer(leaf_modules=_KERNELS).trace(serving)
    except Exception:  # the real trace, later, reports why
        return None
    reads_dense = {n for n in graph.nodes if n.op == "placeholder" and n.target == "dense_features"}
    for node in graph.nodes:  # topological order: every node the dense input flows into
        if any(arg in reads_dense for arg in node.all_input_nodes):
            reads_dense.add(node)

    class Probe(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            width = _input_width(self.fetch_attr(n.target)) if n.op == "call_module" and n in reads_dense else None
            if width is not None:
                args, _ = self.fetch_args_kwargs_from_env(n)
                raise _WidthFound(width - args[0].shape[-1])
            return super().run_node(n)

    example = _example(InferenceSpec(features, 0, weighted, "fp32", {}, ""))
    try:
        with torch.no_grad():
            Probe(torch.fx.GraphModule(serving, graph)).run(*example)
        return None  # no Linear on the dense path
    except _WidthFound as found:
        width = found.width
    except Exception:
        return None
    try:
        with torch.no_grad():
            serving(torch.zeros(2, width), *example[1:])
    except Exception:
        return None
    return width


def _example(spec: InferenceSpec) -> Tuple[Tensor, ...]:
    """Two samples, one id (row 0) per feature: the warm-up call's input."""
    rows = 2
    n = rows * len(spec.features)
    return (
        torch.zeros(rows, spec.num_dense_features),
        torch.zeros(n, dtype=torch.long),
        torch.ones(n, dtype=torch.int32),
        torch.ones(n) if spec.weighted else None,
    )


def _script(model: nn.Module, name: str) -> torch.jit.ScriptModule:
    from torchrec.fx import Tracer

    try:
        graph = Tracer(leaf_modules=_KERNELS).trace(model)
    except Exception as err:  # fx raises several types; the message names the construct
        raise ExportError(
            f"{name} cannot be traced for serving (torch.fx): {type(err).__name__}: {err}. HINT: serving needs a "
            "forward without data-dependent Python control flow (branch on tensor values, .item(), .tolist())."
        ) from err
    try:
        return torch.jit.script(torch.fx.GraphModule(model, graph))
    except Exception as err:
        raise ExportError(f"{name} cannot be compiled with TorchScript: {type(err).__name__}: {err}") from err
