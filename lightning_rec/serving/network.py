"""Which network of a LightningModule serves, and what it reads: the features and tables of its collections, whether
it takes dense features and how wide they are, and the refusals that name the part that cannot be served."""

import copy
import inspect
from typing import Any, cast

import torch
from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection, FeatureProcessorDictWrapper
from torchrec.modules.mc_embedding_modules import (
    BaseManagedCollisionEmbeddingCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)

from lightning_rec import _compat
from lightning_rec._tables import embedding_modules, inner_collection, table_configs
from lightning_rec.errors import ExportError
from lightning_rec.serving.artifact import InferenceSpec, ServingWrapper, example_inputs

__all__ = [
    "KERNELS",
    "call_failed",
    "check_row_width",
    "network_features",
    "num_dense",
    "position_limits",
    "quantize",
    "output_meaning",
    "raw_id_features",
    "served_features",
    "serving_network",
    "takes_dense",
]

KERNELS = ["IntNBitTableBatchedEmbeddingBagsCodegen"]  # FBGEMM's inference kernels: leaves of the fx trace


def serving_network(module: nn.Module, part: str | None) -> nn.Module:
    """What ``module.inference_module(part)`` returns, refused (``ExportError``) unless it is an ``nn.Module`` that
    holds embedding tables."""
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
    found = embedding_modules(net)
    if not found:
        raise ExportError(
            f"{name}.inference_module() returned {type(net).__name__}, which holds no EmbeddingBagCollection or "
            "EmbeddingCollection: there are no tables to serve."
        )
    for path, sub in found.items():
        if isinstance(sub, FeatureProcessedEmbeddingBagCollection) and isinstance(
            sub.split()[0], FeatureProcessorDictWrapper
        ):
            raise ExportError(
                f"{name}: FeatureProcessedEmbeddingBagCollection ({path!r}) takes its feature processors as a dict "
                "(one FeatureProcessor a feature), which TorchRec's quantized module cannot call. HINT: build it with "
                "a FeatureProcessorsCollection, e.g. `PositionWeightedModuleCollection(max_feature_lengths)`."
            )
    return net


def network_features(net: nn.Module) -> tuple[dict[str, int], bool, dict[str, list[int]]]:
    """Every feature the network's table collections read (first-seen order) with the ids it takes (its table's
    rows; for a managed-collision table, the raw id space its collision module remaps: ``input_hash_size``), whether
    any collection pools with weights the caller gives (a position-weighted one makes its own), and the tables'
    ``[rows, columns]``."""
    features: dict[str, int] = {}
    tables: dict[str, list[int]] = {}
    weighted = False
    for sub in embedding_modules(net).values():
        configs = table_configs(sub)
        ids = {config.name: int(config.num_embeddings) for config in configs}
        if isinstance(sub, BaseManagedCollisionEmbeddingCollection):  # raw ids, remapped into the table inside
            ids = {table: int(mc.input_size()) for table, mc in _compat.managed_collision_parts(sub)[2].items()}
        inner = inner_collection(sub)
        if isinstance(inner, EmbeddingBagCollection) and not isinstance(sub, FeatureProcessedEmbeddingBagCollection):
            weighted = weighted or bool(inner.is_weighted())  # (a feature processor computes the weights itself)
        for config in configs:
            features.update(dict.fromkeys(config.feature_names, ids[config.name]))
            tables[config.name] = [int(config.num_embeddings), int(config.embedding_dim)]
    return features, weighted, tables


def raw_id_features(net: nn.Module) -> set[str]:
    """The features of the network's managed-collision tables: raw ids, remapped to rows inside the artifact."""
    found: set[str] = set()
    for sub in embedding_modules(net).values():
        if isinstance(sub, BaseManagedCollisionEmbeddingCollection):
            found.update(f for config in table_configs(sub) for f in config.feature_names)
    return found


def served_features(net: nn.Module, features: list[str]) -> list[str]:
    """The features the artifact takes, in ``features``' (the collections') order: those the network declares as its
    ``serving_features`` (the features its forward reads; the others are passed to its collections empty), else all.

    Example::

        >>> class History(nn.Module):
        ...     serving_features = ("history",)
        >>> served_features(History(), ["history", "target", "catalog"])
        ['history']
    """
    declared = getattr(net, "serving_features", None)
    if declared is None:
        return features
    unknown = [f for f in declared if f not in features]
    if unknown or not declared:
        raise ExportError(
            f"{type(net).__name__}.serving_features names {unknown or 'no feature'}; its collections read {features}."
        )
    return [f for f in features if f in declared]


def output_meaning(net: nn.Module) -> str:
    """What the served network's output is, for the spec: its ``serving_output`` if it says, else the first
    sentence of its class's docstring."""
    said = getattr(net, "serving_output", None)
    if isinstance(said, str):
        return said
    doc = inspect.getdoc(type(net)) or f"what {type(net).__name__}.forward returns"
    return " ".join(doc.split("\n\n")[0].split())


def position_limits(net: nn.Module) -> dict[str, int]:
    """The features of the network with the longest list of ids a sample may bring: a position-weighted feature's
    (``PositionWeightedModuleCollection``) its position weights' length (a longer one reads past them), and those the
    network declares as ``serving_max_lengths`` (a sequence model's ``max_len``: a longer history has no position)."""
    limits: dict[str, int] = {k: int(v) for k, v in (getattr(net, "serving_max_lengths", None) or {}).items()}
    for sub in embedding_modules(net).values():
        if isinstance(sub, FeatureProcessedEmbeddingBagCollection):
            processors = sub.split()[0]
            if isinstance(processors, PositionWeightedModuleCollection):
                limits.update({f: int(n) for f, n in processors.max_feature_lengths.items()})
    return limits


def quantize(serving: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``serving`` with every table module swapped, in place, for TorchRec's quantized inference module holding its
    tables as ``dtype``: ``EmbeddingBagCollection``/``EmbeddingCollection`` (TorchRec's default mapping), the
    managed-collision ones (``QuantManagedCollisionEmbeddingBagCollection``/``...EmbeddingCollection``, which keep
    the trained collision modules, their raw id -> row slots and all, and remap as in eval mode: a raw id no slot
    holds reads the table's last row) and the position-weighted ``FeatureProcessedEmbeddingBagCollection`` (its
    tables as ``dtype`` too; its feature processors, the position weights, stay fp32).

    Example::

        >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        >>> ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        ...     name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])])
        >>> type(quantize(nn.Sequential(ebc), torch.qint8)[0]).__module__
        'torchrec.quant.embedding_modules'
    """
    from torchrec.inference.modules import (
        DEFAULT_QUANT_MAPPING,
        quantize_inference_model,
        trim_torch_package_prefix_from_typename,
    )
    from torchrec.quant.embedding_modules import (
        QuantManagedCollisionEmbeddingBagCollection,
        QuantManagedCollisionEmbeddingCollection,
    )

    mapping = {
        **DEFAULT_QUANT_MAPPING,
        **{
            trim_torch_package_prefix_from_typename(torch.typename(float_type)): quant_type
            for float_type, quant_type in (
                (ManagedCollisionEmbeddingBagCollection, QuantManagedCollisionEmbeddingBagCollection),
                (ManagedCollisionEmbeddingCollection, QuantManagedCollisionEmbeddingCollection),
            )
        },
    }
    return quantize_inference_model(
        serving, quantization_mapping=mapping, fp_weight_dtype=dtype, quantization_dtype=dtype
    )


# FBGEMM packs a quantized row in 2-byte units (ncols x bits must be a multiple of 16).
_ROW_MULTIPLE = {"int8": 2, "int4": 4}


def check_row_width(tables: dict[str, list[int]], table_dtype: str, name: str) -> None:
    """Refuse (``ExportError``) tables whose width FBGEMM cannot store as ``table_dtype``, naming them and the dtypes
    that would fit.

    Example::

        >>> check_row_width({"t_user": [10, 6]}, "int4", "Net")
        Traceback (most recent call last):
        ...
        lightning_rec.errors.ExportError: Net: table(s) t_user (embedding_dim 6) cannot be stored as int4: FBGEMM's int4 rows need an embedding_dim that is a multiple of 4. HINT: --table-dtype int8 or fp16 or fp32.
    """
    multiple = _ROW_MULTIPLE.get(table_dtype)
    odd = {t: dim for t, (_, dim) in tables.items() if multiple and dim % multiple}
    if odd:
        fits = [d for d, m in _ROW_MULTIPLE.items() if all(dim % m == 0 for dim in odd.values())]
        raise ExportError(
            f"{name}: table(s) {', '.join(f'{t} (embedding_dim {d})' for t, d in odd.items())} cannot be stored as "
            f"{table_dtype}: FBGEMM's {table_dtype} rows need an embedding_dim that is a multiple of {multiple}. "
            f"HINT: --table-dtype {' or '.join(fits + ['fp16', 'fp32'])}."
        )


def call_failed(module: nn.Module, net: nn.Module, dense: bool, err: Exception) -> str:
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


def takes_dense(net: nn.Module) -> bool:
    """Whether ``net.forward`` takes ``(dense_features, sparse_features)`` (``False``: ``(sparse_features)``);
    other signatures, and the sparse features first when annotated so, are refused."""
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


def num_dense(module: nn.Module, given: int | None, net: nn.Module, features: list[str], weighted: bool) -> int:
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


def _input_width(module: nn.Module) -> int | None:
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


def _dense_width(net: nn.Module, features: list[str], weighted: bool) -> int | None:
    """The dense width the first ``nn.Linear`` (or ``BatchNorm1d``, ``LayerNorm``) on the dense input's path implies:
    the network is run (``torch.fx`` interpreter, on a copy) with a dense input of width 0, and the width that layer
    takes minus the width it then receives is the dense width, whether the dense input reaches it alone
    (``bottom(dense)``) or concatenated with other columns (``over(cat([kt.values(), dense], 1))``). The answer is
    checked by running the network with it."""
    from torchrec.fx import Tracer

    serving = ServingWrapper(copy.deepcopy(net), features, dense=True)  # a copy: running it fills TorchRec's caches
    try:
        graph = Tracer(leaf_modules=KERNELS).trace(serving)
    except Exception:  # the real trace, later, reports why
        return None
    reads_dense = {n for n in graph.nodes if n.op == "placeholder" and n.target == "dense_features"}
    for node in graph.nodes:  # topological order: every node the dense input flows into
        if any(arg in reads_dense for arg in node.all_input_nodes):
            reads_dense.add(node)

    class Probe(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            # a call_module node's target is the module's path (a str; fx types any target as str | callable)
            width = (
                _input_width(self.fetch_attr(cast(str, n.target)))
                if n.op == "call_module" and n in reads_dense
                else None
            )
            if width is not None:
                args, _ = self.fetch_args_kwargs_from_env(n)
                raise _WidthFound(width - args[0].shape[-1])
            return super().run_node(n)

        def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            # TorchRec's lazy caches append to list constants of the trace (a managed-collision module's feature
            # order), which the interpreter hands over immutable: each call gets its own copy, as the traced code does
            args = tuple(list(a) if isinstance(a, list) else a for a in args)
            return super().call_function(target, args, kwargs)

    example = example_inputs(InferenceSpec(features, 0, weighted, "fp32", {}, ""))
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
