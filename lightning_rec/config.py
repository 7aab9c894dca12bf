"""The typed configuration users write: embedding optimizers, sharding constraints and topology, sparse features.

These are plain dataclasses (YAML-friendly: the CLI builds them from configs, ``save_hyperparameters()`` records
them, checkpoints' allow-list admits them), kept below every other module so that models, checkpoints, input
checks and reports import configuration, never the strategy's machinery. The most used are importable from
``lightning_rec`` too.

Example::

    >>> TableConstraints(sharding_types=["COLUMN_WISE"]).sharding_types
    ['column_wise']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeVar, cast, overload

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
from torch.optim import Optimizer
from torchrec.distributed.planner import ParameterConstraints

from lightning_rec._choices import did_you_mean

__all__ = [
    "BoundsCheck",
    "EmbeddingOptimizer",
    "NonFinitePolicy",
    "OptimizerName",
    "QuantizedComms",
    "SEQUENCE_FEATURES",
    "SparseFeature",
    "TableConstraints",
    "TopologyConfig",
    "checkpoint_safe",
    "checkpoint_safe_classes",
    "supported_optimizers",
]

# ---------------------------------------------------------------------------------------------------------
# Policies (what the strategy does with bad input), and the classes checkpoints may hold.
# ---------------------------------------------------------------------------------------------------------

BoundsCheck = Literal["error", "warn", "ignore", "none"]
"""Ids outside a table: raise (``"error"``), FBGEMM's warn/ignore and read row 0, or no check at all (``"none"``)."""

NonFinitePolicy = Literal["error", "strict", "warn", "ignore"]
"""NaN/inf in a dense input or the loss: raise (a step late / ``"strict"``: before the step), warn, or ignore."""

_C = TypeVar("_C", bound=type)
# class -> the module paths older checkpoints name it by
_CHECKPOINT_SAFE: dict[type, tuple[str, ...]] = {}


@overload
def checkpoint_safe(cls: _C, *, old_paths: Iterable[str] = ()) -> _C: ...
@overload
def checkpoint_safe(cls: None = None, *, old_paths: Iterable[str] = ()) -> Callable[[_C], _C]: ...
def checkpoint_safe(cls: _C | None = None, *, old_paths: Iterable[str] = ()) -> _C | Callable[[_C], _C]:
    """Allow instances of ``cls`` in a checkpoint's hyperparameters (``meta.pt``), which is otherwise loaded with
    ``torch.load(weights_only=True)`` and refuses every class it does not know. A class decorator.

    Only register plain data holders (dataclasses without ``__setstate__``/``__reduce__``): unpickling them runs no
    code of theirs. ``old_paths``: where the class lived before (``"pkg.old_module.Name"``), for checkpoints written
    then. The class's module must be imported before the checkpoint is loaded (it is, when the model that records
    it is).

    Example::

        >>> from dataclasses import dataclass
        >>> @checkpoint_safe
        ... @dataclass
        ... class Tower:
        ...     layers: tuple = (64, 32)
        >>> Tower in checkpoint_safe_classes()
        True
    """

    def register(klass: _C) -> _C:
        _CHECKPOINT_SAFE[klass] = tuple(dict.fromkeys([*_CHECKPOINT_SAFE.get(klass, ()), *old_paths]))
        return klass

    return register if cls is None else register(cls)


def checkpoint_safe_classes() -> list[Any]:
    """Everything :func:`checkpoint_safe` registered, as ``torch.serialization.safe_globals`` takes it: each class,
    and a ``(class, old path)`` pair per old path."""
    return [entry for cls, paths in _CHECKPOINT_SAFE.items() for entry in (cls, *((cls, p) for p in paths))]


# ---------------------------------------------------------------------------------------------------------
# The fused embedding optimizer.
# ---------------------------------------------------------------------------------------------------------

OptimizerName = Literal[
    "sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb"
]


@dataclass(frozen=True)
class _OptimizerFacts:
    """What is true of one fused embedding optimizer, in one place (the strategy, the planner's storage estimate,
    the device checks and checkpoint state conversion all read it here).

    Args:
        emb_opt_type: FBGEMM's update rule.
        cpu: FBGEMM ships CPU kernels for it (the others are CUDA-only).
        variable_batch: FBGEMM's table-batched kernels train variable-batch (VBE) inputs with it.
        planner_state: the torch optimizer class whose state TorchRec's planner adds to a table's storage estimate
            (its estimator knows SGD: none, Adam: two copies, RowWiseAdagrad: one float per row; any other class:
            one copy; partial row-wise Adam/LAMB, a full first moment and a row-wise second, count as one copy).
        torch_equivalent: the same rule as an ordinary torch optimizer, for tables TorchRec keeps on a non-fused
            kernel (``None``: it exists only as a fused kernel).
        state_names: the fused state's names -> the torch equivalent's (``momentum1`` -> ``sum``, ...).
    """

    emb_opt_type: EmbOptimType
    cpu: bool
    variable_batch: bool
    planner_state: str
    torch_equivalent: str | None
    state_names: tuple[tuple[str, str], ...] = ()


_OPTIMIZER_FACTS: dict[str, _OptimizerFacts] = {
    "sgd": _OptimizerFacts(EmbOptimType.EXACT_SGD, True, True, "SGD", "SGD"),
    "adagrad": _OptimizerFacts(EmbOptimType.EXACT_ADAGRAD, True, False, "Adagrad", "Adagrad", (("momentum1", "sum"),)),
    "rowwise_adagrad": _OptimizerFacts(
        EmbOptimType.EXACT_ROWWISE_ADAGRAD, True, True, "RowWiseAdagrad", "RowWiseAdagrad", (("momentum1", "sum"),)
    ),
    "adam": _OptimizerFacts(
        EmbOptimType.ADAM, False, True, "Adam", "Adam", (("momentum1", "exp_avg"), ("momentum2", "exp_avg_sq"))
    ),
    "partial_rowwise_adam": _OptimizerFacts(EmbOptimType.PARTIAL_ROWWISE_ADAM, False, False, "Adagrad", None),
    "lamb": _OptimizerFacts(EmbOptimType.LAMB, False, False, "Adam", None),
    "partial_rowwise_lamb": _OptimizerFacts(EmbOptimType.PARTIAL_ROWWISE_LAMB, False, False, "Adagrad", None),
}
_EMB_OPT_TYPES: dict[str, EmbOptimType] = {name: f.emb_opt_type for name, f in _OPTIMIZER_FACTS.items()}
_CPU_OPTIMIZERS = tuple(name for name, f in _OPTIMIZER_FACTS.items() if f.cpu)


def supported_optimizers(device_type: str) -> tuple[str, ...]:
    """Names of the fused embedding optimizers FBGEMM can run on ``device_type``.

    Example::

        >>> supported_optimizers("cpu")
        ('sgd', 'adagrad', 'rowwise_adagrad')
    """
    return tuple(_EMB_OPT_TYPES) if device_type == "cuda" else _CPU_OPTIMIZERS


@checkpoint_safe
@dataclass
class EmbeddingOptimizer:
    """A fused embedding optimizer: which FBGEMM update rule runs in the backward pass, and its hyperparameters.

    Args:
        name: the update rule. ``rowwise_adagrad`` keeps one accumulator per row (the usual choice for big
            tables); ``adagrad`` one per element; ``sgd`` none. ``adam``/``lamb`` and their partial-row-wise
            variants exist on CUDA only.
        lr: learning rate.
        eps: the epsilon of Adagrad/Adam style updates.
        weight_decay: L2 weight decay (0 disables it).
        betas: Adam/LAMB moment coefficients.

    Example::

        >>> EmbeddingOptimizer("rowwise_adagrad", lr=0.05).to_fused_params()["learning_rate"]
        0.05
    """

    name: OptimizerName = "rowwise_adagrad"
    lr: float = 0.01
    eps: float = 1e-8
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)

    def __post_init__(self) -> None:
        if self.name not in _EMB_OPT_TYPES:
            raise ValueError(
                f"EmbeddingOptimizer: unknown optimizer {self.name!r}. Choose one of {sorted(_EMB_OPT_TYPES)}"
                f"{did_you_mean(self.name, sorted(_EMB_OPT_TYPES)) or '.'}"
            )
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ValueError(f"EmbeddingOptimizer: lr must be a finite number >= 0, got {self.lr!r}.")
        self.betas = cast(tuple[float, float], tuple(self.betas))  # YAML gives lists

    def validate_for(self, device_type: str) -> None:
        """Raise if FBGEMM has no kernel for this optimizer on ``device_type`` (``"cpu"`` or ``"cuda"``)."""
        ok = supported_optimizers(device_type)
        if self.name not in ok:
            raise ValueError(
                f"The fused embedding optimizer {self.name!r} has no FBGEMM kernel on {device_type.upper()}. "
                f"Supported there: {', '.join(ok)}. HINT: use `rowwise_adagrad` (the usual choice for large "
                "tables), declare it with `RecLightningModule.configure_embedding_optimizer()` or the strategy's "
                "`embedding_optimizer=` argument, or train on CUDA."
            )

    def to_fused_params(self) -> dict[str, Any]:
        """TorchRec ``fused_params`` (FBGEMM TBE keyword arguments) for this optimizer."""
        params: dict[str, Any] = {
            "optimizer": _EMB_OPT_TYPES[self.name],
            "learning_rate": self.lr,
            "eps": self.eps,
            "beta1": self.betas[0],
            "beta2": self.betas[1],
        }
        if self.weight_decay:
            params["weight_decay"] = self.weight_decay
            params["weight_decay_mode"] = WeightDecayMode.L2
        return params

    def torch_optimizer(self, params: Iterable[torch.Tensor]) -> Optimizer:
        """The same update rule as an ordinary torch optimizer, for tables TorchRec keeps on a non-fused
        (``dense``) kernel, e.g. ``data_parallel`` tables on CPU."""
        params = list(params)
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay)
        if self.name == "adagrad":
            return torch.optim.Adagrad(params, lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)
        if self.name == "rowwise_adagrad":
            from torchrec.optim import RowWiseAdagrad

            return RowWiseAdagrad(params, lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)
        if self.name == "adam":
            return torch.optim.Adam(params, lr=self.lr, eps=self.eps, betas=self.betas, weight_decay=self.weight_decay)
        equivalents = [name for name, f in _OPTIMIZER_FACTS.items() if f.torch_equivalent is not None]
        raise ValueError(
            f"EmbeddingOptimizer {self.name!r} exists only as a fused kernel; a table on a non-fused kernel "
            f"needs {', '.join(equivalents)}. HINT: constrain that table to the 'fused' compute kernel."
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain-data form, for logs and checkpoints."""
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------
# The sharding planner's inputs.
# ---------------------------------------------------------------------------------------------------------


@checkpoint_safe
@dataclass
class TableConstraints:
    """What the planner may do with one table (a YAML-friendly ``ParameterConstraints``).

    Args:
        sharding_types: allowed sharding types, e.g. ``["table_wise", "column_wise"]`` (names of
            ``torchrec.distributed.types.ShardingType`` values, case-insensitive).
        compute_kernels: allowed compute kernels, e.g. ``["fused"]``.
        min_partition: smallest column block when sharding column-wise.
        pooling_factors: expected ids per sample for each feature of the table (helps the cost model).

    Example::

        RecShardStrategy(constraints={"item_id": TableConstraints(sharding_types=["column_wise"])})
    """

    sharding_types: list[str] | None = None
    compute_kernels: list[str] | None = None
    min_partition: int | None = None
    pooling_factors: list[float] | None = None

    def __post_init__(self) -> None:
        if self.sharding_types is not None:
            self.sharding_types = [s.lower() for s in self.sharding_types]
        if self.compute_kernels is not None:
            self.compute_kernels = [k.lower() for k in self.compute_kernels]

    def to_torchrec(self) -> ParameterConstraints:
        """The equivalent ``torchrec.distributed.planner.ParameterConstraints``."""
        kwargs: dict[str, Any] = dict(
            sharding_types=self.sharding_types,
            compute_kernels=self.compute_kernels,
            min_partition=self.min_partition,
        )
        if self.pooling_factors is not None:
            kwargs["pooling_factors"] = list(self.pooling_factors)
        return ParameterConstraints(**kwargs)


@checkpoint_safe
@dataclass
class TopologyConfig:
    """Overrides for the planner's view of the machines (everything else is detected).

    Args:
        hbm_cap: device (GPU) memory per rank in bytes the planner may fill.
        ddr_cap: host memory per rank in bytes (the table memory on CPU training).
        local_world_size: ranks per host (affects intra- vs inter-host communication costs).
        batch_size: per-rank batch size the planner assumes for its cost model.
        preset: a named device (``"h100"``, ``"h200"``, ``"a100-80g"``, ``"a100-40g"``, ``"cpu"``: see
            :data:`lightning_rec._planner.topology.DEVICE_PRESETS`) whose memory and bandwidths the planner assumes
            (``hbm_cap``/``ddr_cap`` still override its memory). Default: TorchRec's own defaults.

    Example::

        RecShardStrategy(topology=TopologyConfig(ddr_cap=8 * 1024**3, batch_size=4096))
        RecShardStrategy(topology={"preset": "h100"})
    """

    hbm_cap: int | None = None
    ddr_cap: int | None = None
    local_world_size: int | None = None
    batch_size: int | None = None
    preset: str | None = None

    def ranks_per_host(self, launched: int) -> int:
        """The planner's local world size: this override, else ``launched`` (ranks per host as started)."""
        return self.local_world_size or launched


CommPrecision = Literal["fp32", "fp16", "bf16", "int8", "fp8"]
"""A precision of the embedding all-to-alls (TorchRec's ``CommType``, lower case)."""

_COMM_PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")


@checkpoint_safe
@dataclass
class QuantizedComms:
    """Precision of the pooled/sequence embedding all-to-alls (and row-wise reduce-scatters) in the forward pass and
    of their gradients in the backward pass: TorchRec's ``QCommsConfig`` through FBGEMM's codecs. The tables and
    dense layers keep their own precision; only what travels between ranks is quantized.

    Args:
        forward: ``"fp32"`` (no quantization), ``"fp16"``, ``"bf16"``, ``"int8"`` or ``"fp8"`` (CUDA only).
        backward: the same, for the gradients (default: as ``forward``).
        forward_loss_scale, backward_loss_scale: TorchRec's scales for fp16 (numerical headroom).

    On CPU (gloo): fp16 and bf16 run under every sharding type; int8 runs for pooled tables sharded table-wise,
    column-wise or data-parallel (FBGEMM's int8 codec fails in the row-wise reduce-scatter and on sequence
    embeddings there); fp8 has no CPU kernel. What cannot run is refused before anything is sharded.

    Example::

        RecShardStrategy(qcomms="fp16")                                   # both directions
        RecShardStrategy(qcomms={"forward": "fp16", "backward": "bf16"})
        RecShardStrategy(qcomms=QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16))

        >>> QuantizedComms.of({"forward_precision": "fp16", "backward_precision": "bf16"}).precisions
        ('fp16', 'bf16')
    """

    forward: CommPrecision = "fp32"
    backward: CommPrecision | None = None
    forward_loss_scale: float | None = None
    backward_loss_scale: float | None = None

    def __post_init__(self) -> None:
        self.forward = cast(CommPrecision, self.forward.lower())
        self.backward = cast(CommPrecision, (self.backward or self.forward).lower())
        for direction, value in (("forward", self.forward), ("backward", self.backward)):
            if value not in _COMM_PRECISIONS:
                raise ValueError(
                    f"QuantizedComms: {direction} precision {value!r} is not one of {', '.join(_COMM_PRECISIONS)}"
                    f"{did_you_mean(value, _COMM_PRECISIONS) or '.'}"
                )

    @classmethod
    def of(cls, value: QuantizedComms | str | dict[str, Any] | Any | None) -> QuantizedComms | None:
        """From what ``RecShardStrategy(qcomms=...)`` takes: this class, a precision for both directions, a dict of
        its arguments, or TorchRec's ``QCommsConfig``; ``None`` and full precision give ``None``."""
        if value is None:
            return None
        if isinstance(value, str):
            value = cls(forward=cast(CommPrecision, value))
        elif isinstance(value, dict):  # also with QCommsConfig's names (forward_precision, backward_precision)
            renamed = {"forward_precision": "forward", "backward_precision": "backward"}
            kwargs: dict[str, Any] = {
                renamed.get(k, k): str(v.value if hasattr(v, "value") else v) if k in renamed else v
                for k, v in value.items()
            }
            value = cls(**kwargs)
        elif not isinstance(value, cls):  # TorchRec's QCommsConfig (untyped)
            config: Any = value
            value = cls(
                forward=cast(CommPrecision, str(config.forward_precision)),
                backward=cast(CommPrecision, str(config.backward_precision)),
                forward_loss_scale=config.forward_loss_scale,
                backward_loss_scale=config.backward_loss_scale,
            )
        return None if value.forward == value.backward == "fp32" else value

    @property
    def precisions(self) -> tuple[str, str]:
        """``(forward, backward)``."""
        return self.forward, self.backward or self.forward

    def to_torchrec(self) -> Any:
        """TorchRec's ``QCommsConfig``."""
        from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig

        return QCommsConfig(
            forward_precision=CommType(self.forward),
            backward_precision=CommType(self.backward or self.forward),
            forward_loss_scale=self.forward_loss_scale,
            backward_loss_scale=self.backward_loss_scale,
        )


# ---------------------------------------------------------------------------------------------------------
# What the DataModules publish and the models build tables from.
# ---------------------------------------------------------------------------------------------------------

SEQUENCE_FEATURES = ("history", "target", "negatives", "catalog")
"""The ``KeyedJaggedTensor`` keys of a sequence batch (:class:`~lightning_rec.data.MovieLensSequenceDataModule`),
all read by the one item table of :class:`~lightning_rec.models.SequentialRecModule`."""


@checkpoint_safe
@dataclass(frozen=True)
class SparseFeature:
    """A categorical feature and the number of rows its embedding table needs.

    DataModules publish their features as a list of these; models build one table per feature from it (the
    CLI links ``data.sparse_features`` to ``model.sparse_features``).

    Args:
        name: the feature's key in the ``KeyedJaggedTensor`` (and the table's name, prefixed ``t_``).
        num_embeddings: ids run from 0 to ``num_embeddings - 1``.
        multi_hot: whether a sample may carry several ids (or none), e.g. a movie's genres.
        table: the feature whose table this one shares (``None``: its own table). Features sharing a table look
            up the same rows (e.g. a user's history of items and the candidate item).

    Example::

        >>> SparseFeature("user_id", 944)
        SparseFeature(name='user_id', num_embeddings=944, multi_hot=False, table=None)
    """

    name: str
    num_embeddings: int
    multi_hot: bool = False
    table: str | None = None

    def __post_init__(self) -> None:
        if self.num_embeddings < 1:
            raise ValueError(f"SparseFeature {self.name!r}: num_embeddings must be >= 1, got {self.num_embeddings}.")
