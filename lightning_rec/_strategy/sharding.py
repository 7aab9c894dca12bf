"""From tables, topology and per-table constraints to a TorchRec ``ShardingPlan``, and the sharders that carry it out.

The planner itself is TorchRec's ``EmbeddingShardingPlanner``; this module turns typed, YAML-friendly
configuration into its inputs and checks them against the model and device before any distributed work (the
resulting plan as a table people can read is :mod:`lightning_rec._strategy.plan_report`). It also holds:

* the sharders of every TorchRec embedding module that trains (:func:`make_sharders`: EBC and EC, position-weighted
  and managed-collision ones, with the fused optimizer and quantized comms passed into each, a user's too);
* what TorchRec can run on each device, found by trying each on CPU, and the refusals that name what cannot
  (:func:`validate_constraints`, :func:`check_qcomms`, :func:`check_managed_collision`, :func:`vbe_refusals`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import get_qcomm_codecs_registry
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingConfig
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

from lightning_rec import _compat
from lightning_rec._strategy.topology import DevicePreset, make_topology
from lightning_rec._tables import embedding_modules, embedding_tables
from lightning_rec.config import QuantizedComms, TableConstraints, TopologyConfig

# What TorchRec can train with on each device. TorchRec's EBC sharder lists row_wise, table_row_wise and grid_shard for
# CUDA only, yet over gloo on CPU they train exactly like the unsharded module (tests/strategy/test_torchrec_models.py),
# so EBCSharder offers them there too. Its EC sharder lists table_wise, column_wise, row_wise and data_parallel on
# every device; data-parallel EmbeddingCollections fail on CPU in TorchRec 1.8 (their output lengths do not match their
# values), so they are left out there.
_POOLED_SHARDING_TYPES = (
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.DATA_PARALLEL.value,
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.GRID_SHARD.value,
)
_SEQUENCE_SHARDING_TYPES = (
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.DATA_PARALLEL.value,
)
# Kernels that train (the quantised ones are inference-only); UVM kernels need CUDA.
_CPU_KERNELS = (EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value)
_CUDA_KERNELS = _CPU_KERNELS + (
    EmbeddingComputeKernel.FUSED_UVM.value,
    EmbeddingComputeKernel.FUSED_UVM_CACHING.value,
)
# The fused_params keys that describe the embedding optimizer (EmbeddingOptimizer.to_fused_params writes them).
_OPTIMIZER_KEYS = ("optimizer", "learning_rate", "eps", "beta1", "beta2", "weight_decay", "weight_decay_mode")


class EBCSharder(EmbeddingBagCollectionSharder):
    """TorchRec's ``EmbeddingBagCollectionSharder``, offering ``row_wise``, ``table_row_wise`` and ``grid_shard`` on
    CPU too (TorchRec lists them for CUDA only; over gloo they train exactly like the unsharded module).

    Example::

        sharder = EBCSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
        "row_wise" in sharder.sharding_types("cpu")   # True
    """

    def sharding_types(self, compute_device_type: str) -> list[str]:  # noqa: D102
        return super().sharding_types("cuda" if compute_device_type == "cpu" else compute_device_type)


def _kernels_on(kernels: list[str], compute_device_type: str) -> list[str]:
    """A managed-collision sharder lists FBGEMM's UVM and key-value kernels on every device; on CPU only ``fused``
    runs (TorchRec's CPU planner otherwise picks ``fused_uvm``)."""
    return kernels if compute_device_type == "cuda" else [k for k in kernels if k in _CPU_KERNELS]


class MCEBCSharder(ManagedCollisionEmbeddingBagCollectionSharder):
    """TorchRec's ``ManagedCollisionEmbeddingBagCollectionSharder`` (row-wise tables, the raw id space split across
    ranks with them), with the fused kernel on CPU; its tables go through ``ebc_sharder`` (default
    :class:`EBCSharder`, which admits row-wise on CPU)."""

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:  # noqa: D102
        return _kernels_on(super().compute_kernels(sharding_type, compute_device_type), compute_device_type)


class MCECSharder(ManagedCollisionEmbeddingCollectionSharder):
    """TorchRec's ``ManagedCollisionEmbeddingCollectionSharder``, as :class:`MCEBCSharder` for unpooled tables."""

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:  # noqa: D102
        return _kernels_on(super().compute_kernels(sharding_type, compute_device_type), compute_device_type)


def supported_sharding_types(device_type: str, sequence: bool = False) -> tuple[str, ...]:
    """Sharding types TorchRec can train with on ``device_type``.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        sequence: for a table of an ``EmbeddingCollection`` (unpooled): TorchRec shards those table-wise,
            column-wise, row-wise or data-parallel; data-parallel fails on CPU in TorchRec 1.8 (its output lengths
            do not match its values), so it is left out there.

    Example::

        >>> supported_sharding_types("cpu")
        ('table_wise', 'column_wise', 'table_column_wise', 'data_parallel', 'row_wise', 'table_row_wise', 'grid_shard')
        >>> supported_sharding_types("cpu", sequence=True)
        ('table_wise', 'column_wise', 'row_wise')
    """
    if not sequence:
        return _POOLED_SHARDING_TYPES
    if device_type == "cuda":
        return _SEQUENCE_SHARDING_TYPES
    return tuple(t for t in _SEQUENCE_SHARDING_TYPES if t != ShardingType.DATA_PARALLEL.value)


def supported_kernels(device_type: str) -> tuple[str, ...]:
    """Compute kernels that train on ``device_type`` (UVM kernels need CUDA; quantized ones only serve).

    Example::

        >>> supported_kernels("cpu")
        ('fused', 'dense')
    """
    return _CUDA_KERNELS if device_type == "cuda" else _CPU_KERNELS


def validate_constraints(
    constraints: Mapping[str, TableConstraints], tables: Mapping[str, BaseEmbeddingConfig], device_type: str
) -> None:
    """Check per-table constraints against the model's tables and what ``device_type`` can run.

    Args:
        constraints: by table name.
        tables: the model's tables by name (see :func:`embedding_tables`).
        device_type: ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: naming every unknown table, sharding type or kernel, and what is allowed instead.
    """
    names = set(tables)
    problems: list[str] = []
    unknown = sorted(set(constraints) - names)
    if unknown:
        problems.append(f"constraints name unknown tables {unknown}; the model's tables are {sorted(names)}")
    kernels_ok = supported_kernels(device_type)
    for table, c in sorted(constraints.items()):
        types_ok = supported_sharding_types(device_type, isinstance(tables.get(table), EmbeddingConfig))
        for st in c.sharding_types or []:
            if st not in types_ok:
                problems.append(
                    f"table {table!r}: sharding type {st!r} cannot run on {device_type.upper()}"
                    f"{' for an EmbeddingCollection table' if isinstance(tables.get(table), EmbeddingConfig) else ''}; "
                    f"supported there: {', '.join(types_ok)}"
                )
        for k in c.compute_kernels or []:
            if k not in kernels_ok:
                problems.append(
                    f"table {table!r}: compute kernel {k!r} cannot train on {device_type.upper()}; "
                    f"supported there: {', '.join(kernels_ok)}"
                )
    if problems:
        raise ValueError("Invalid sharding constraints:\n  - " + "\n  - ".join(problems))


# On CPU (gloo), what FBGEMM's int8 codec cannot carry: the reduce-scatter of row-wise shardings (its encoder gets no
# context there) and sequence embeddings (their sizes are no multiple of its row block). Found by trying each.
_INT8_CPU_UNSUPPORTED = (
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.GRID_SHARD.value,
)


def check_qcomms(
    qcomms: QuantizedComms | None,
    tables: Mapping[str, BaseEmbeddingConfig],
    constraints: Mapping[str, TableConstraints],
    device_type: str,
) -> None:
    """Refuse quantized comms that cannot run on ``device_type`` with these tables, naming the tables and why.

    Raises:
        ValueError: fp8 on CPU (FBGEMM's fp8 codec has no CPU kernel); int8 on CPU for an EmbeddingCollection's
            tables or a table constrained to a row-wise sharding type.
    """
    if qcomms is None or device_type == "cuda":
        return
    precisions = qcomms.precisions
    if "fp8" in precisions:
        raise ValueError(
            "Quantized comms: fp8 cannot run on CPU (FBGEMM's fp8 codec has no CPU kernel). "
            "HINT: use 'fp16' or 'bf16' there (or 'int8' for pooled tables)."
        )
    if "int8" not in precisions:
        return
    sequence = sorted(name for name, config in tables.items() if isinstance(config, EmbeddingConfig))
    row_wise = sorted(
        name for name, c in constraints.items() if set(c.sharding_types or ()) & set(_INT8_CPU_UNSUPPORTED)
    )
    problems = []
    if sequence:
        problems.append(f"EmbeddingCollection tables {sequence} (FBGEMM's int8 codec fails on sequence embeddings)")
    if row_wise:
        problems.append(
            f"tables {row_wise} constrained to row_wise/table_row_wise/grid_shard (its row-wise reduce-scatter fails)"
        )
    if problems:
        raise ValueError(
            "Quantized comms: int8 cannot run on CPU for " + "; ".join(problems) + ". HINT: use 'fp16' or 'bf16', "
            "or shard these tables table-wise or column-wise."
        )


def check_managed_collision(
    module: nn.Module,
    module_types: Sequence[type[nn.Module]],
    constraints: Mapping[str, TableConstraints],
    world_size: int,
    device_type: str,
) -> None:
    """Refuse managed-collision modules TorchRec cannot shard here, before any planning, naming the table and why.

    TorchRec shards a managed-collision table row-wise only, each rank owning a block of its raw id space and of its
    rows; the collision module's ``buckets`` must split evenly over the ranks. Its hash-based
    ``HashZchManagedCollisionModule`` trains on CUDA only (FBGEMM's CPU kernel is read-only). A collision module left
    at the default ``input_hash_size`` (2**63 - 1) is warned about on several ranks: ids are routed to a rank by
    their block of that space, so every realistic id lands on rank 0 and the other ranks' rows stay unused.

    Raises:
        ValueError: naming every problem.
    """
    from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule

    problems, default_space = [], []
    for path, sub in embedding_modules(module, module_types).items():
        if not isinstance(sub, BaseManagedCollisionEmbeddingCollection):
            continue
        for table, mc in _compat.managed_collision_parts(sub)[2].items():
            where = f"table {table!r} ({path})"
            types = (constraints.get(table) or TableConstraints()).sharding_types
            if types and types != [ShardingType.ROW_WISE.value]:
                problems.append(f"{where} is managed-collision, which TorchRec shards row_wise only (asked: {types})")
            if isinstance(mc, HashZchManagedCollisionModule) and device_type != "cuda":
                problems.append(
                    f"{where} uses HashZchManagedCollisionModule, whose FBGEMM kernel trains on CUDA only (on CPU it "
                    "is read-only); use MCHManagedCollisionModule there"
                )
            elif mc.buckets() % world_size:
                problems.append(
                    f"{where}: its collision module has buckets={mc.buckets()}, which does not split over "
                    f"{world_size} ranks; build it with buckets={world_size} (or a multiple)"
                )
            if world_size > 1 and mc.input_size() >= 2**62:
                default_space.append(table)
    if problems:
        raise ValueError("Managed-collision tables cannot be sharded as built:\n  - " + "\n  - ".join(problems))
    if default_space:
        rank_zero_warn(
            f"Managed-collision tables {default_space} keep the default input_hash_size (2**63 - 1): raw ids are "
            "routed to a rank by their block of that space, so every id below 2**62 goes to rank 0 and the other "
            "ranks' rows stay unused. HINT: give MCHManagedCollisionModule the real id range as input_hash_size."
        )


# FBGEMM's table-batched kernels train variable-batch (VBE) inputs with these fused optimizers only.
_VBE_OPTIMIZERS = ("sgd", "rowwise_adagrad", "adam")
# On CPU TorchRec 1.8 fails on VBE inputs of data-parallel tables (its lookup splits them wrongly), and on several
# gloo ranks on row-wise ones (their gradients are all-gathered in uneven sizes, and gloo's all-gather takes equal
# ones); on one rank row-wise ones train exactly. Found by trying each.
_VBE_CPU_UNSUPPORTED = (ShardingType.DATA_PARALLEL.value,)
_VBE_GLOO_UNSUPPORTED = (
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.GRID_SHARD.value,
)


def vbe_refusals(
    plan: ShardingPlan, optimizer_names: Sequence[str], device_type: str, world_size: int = 1
) -> dict[str, str]:
    """Why each sharded module of ``plan`` cannot train on a variable-batch-per-feature KJT, by module path (modules
    that can are left out): the input checks refuse such a batch at the module's door, naming the reason.

    Example::

        >>> vbe_refusals(ShardingPlan(plan={}), ["adagrad"], "cpu", world_size=2)
        {}
    """
    refusals: dict[str, str] = {}
    for path, tables in plan.plan.items():
        reasons = []
        others = [name for name in optimizer_names if name not in _VBE_OPTIMIZERS]
        if others:
            reasons.append(
                f"FBGEMM's kernels train variable-batch inputs with {', '.join(_VBE_OPTIMIZERS)} only, and the "
                f"tables use {', '.join(others)}"
            )
        if device_type != "cuda":
            unsupported = _VBE_CPU_UNSUPPORTED + (_VBE_GLOO_UNSUPPORTED if world_size > 1 else ())
            odd = sorted(f"{t} ({p.sharding_type})" for t, p in tables.items() if p.sharding_type in unsupported)
            if odd:
                reasons.append(
                    "on CPU TorchRec fails on them for data-parallel tables, and over several gloo ranks for "
                    f"row-wise ones: {', '.join(odd)}"
                )
        if reasons:
            refusals[path] = "; ".join(reasons)
    return refusals


def qcomms_registry(qcomms: QuantizedComms | None) -> dict[str, Any] | None:
    """TorchRec's codec registry for ``qcomms`` (``None``: full precision)."""
    if qcomms is None:
        return None
    # No device: TorchRec then keeps bf16 as asked. Given the CPU device it replaces bf16 by fp16 ("not supported on
    # GLOO"), yet gloo carries bfloat16 all-to-alls with this torch (tests/strategy/test_torchrec_models.py).
    return get_qcomm_codecs_registry(qcomms.to_torchrec())


def default_constraints(
    tables: Mapping[str, BaseEmbeddingConfig], device_type: str, qcomms: QuantizedComms | None = None
) -> dict[str, TableConstraints]:
    """Constraints that keep the planner to what ``device_type`` can run (TorchRec's planner would otherwise
    propose CUDA-only shardings on a CPU job, and row-wise ones that int8 ``qcomms`` cannot carry there). A table whose width is not a multiple of 4 is kept data-parallel where
    it can be: TorchRec's fused kernels refuse it (``local_cols`` not divisible by 4), the dense one takes it."""
    int8_on_cpu = qcomms is not None and "int8" in qcomms.precisions and device_type != "cuda"
    constraints = {}
    for name, config in tables.items():
        types = supported_sharding_types(device_type, isinstance(config, EmbeddingConfig))
        if int8_on_cpu:  # see check_qcomms
            types = tuple(t for t in types if t not in _INT8_CPU_UNSUPPORTED)
        if config.embedding_dim % 4:
            types = tuple(t for t in types if t == ShardingType.DATA_PARALLEL.value) or types
        constraints[name] = TableConstraints(sharding_types=list(types))
    return constraints


def make_planner(
    *,
    world_size: int,
    device_type: str,
    topology: TopologyConfig | None,
    constraints: Mapping[str, TableConstraints],
    local_world_size: int | None = None,
    preset: DevicePreset | None = None,
    batch_size: int | None = None,
) -> EmbeddingShardingPlanner:
    """TorchRec's planner for this job: its topology (``world_size`` ranks, ``local_world_size`` of them per host,
    the memory and bandwidths of ``preset``, with ``topology`` overrides) and constraints.

    Args:
        local_world_size: ranks per host, as the launcher started them (the strategy passes its devices per
            node); ``topology.local_world_size`` overrides it; default: all ranks on one host.
        preset: the devices' memory and bandwidths (default: see :func:`~lightning_rec._strategy.topology.default_preset`).
        batch_size: per-rank batch size of the cost model (default: ``topology.batch_size``, else TorchRec's 512).
    """
    topo = topology or TopologyConfig()
    planner_topology = make_topology(
        world_size=world_size,
        local_world_size=topo.ranks_per_host(local_world_size or world_size),
        device_type=device_type,
        topology=topo,
        preset=preset,
    )
    batch = batch_size or topo.batch_size or BATCH_SIZE
    torchrec_constraints = {name: c.to_torchrec() for name, c in constraints.items()}
    return EmbeddingShardingPlanner(
        topology=planner_topology,
        batch_size=batch,
        enumerator=_compat.ordered_enumerator(planner_topology, batch, torchrec_constraints),
        # TorchRec's recommended reservation (its heuristic default warns that it over-estimates dense size).
        storage_reservation=FixedPercentageStorageReservation(percentage=0.15),
        constraints=torchrec_constraints,
        debug=False,
    )


def table_storage_options(
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    planner: EmbeddingShardingPlanner,
) -> dict[str, list[Any]]:
    """Every sharding option TorchRec's enumerator proposes for each table of ``module`` under ``planner``'s
    topology, constraints and batch size, with each shard's storage estimated (what the planner packs onto ranks),
    by table name. For explaining why a model does not fit."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator

    topology, constraints = _compat.planner_topology(planner), _compat.planner_constraints(planner)
    enumerator = EmbeddingEnumerator(
        topology=topology,
        batch_size=_compat.planner_batch_size(planner),
        constraints=constraints,
        estimator=EmbeddingStorageEstimator(topology=topology, constraints=constraints),
    )
    options: dict[str, list[Any]] = {}
    for option in enumerator.enumerate(module, sharders):
        options.setdefault(option.name, []).append(option)
    return options


def plan_sharding(
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    planner: EmbeddingShardingPlanner,
    pg: dist.ProcessGroup | None,
) -> ShardingPlan:
    """Plan on rank 0 and broadcast the result, so every rank shards identically."""
    if pg is not None and dist.is_initialized():
        return planner.collective_plan(module, sharders, pg)
    return planner.plan(module, sharders)


def make_sharders(
    fused_params: Mapping[str, Any],
    extra: Sequence[ModuleSharder[nn.Module]] = (),
    owner: str = "RecShardStrategy",
    qcomms: QuantizedComms | None = None,
) -> list[ModuleSharder[nn.Module]]:
    """A sharder for every TorchRec embedding module that trains, each with ``fused_params`` (the fused optimizer
    and FBGEMM's arguments).

    The built-in ones are :class:`EBCSharder`, TorchRec's ``EmbeddingCollectionSharder`` and
    ``FeatureProcessedEmbeddingBagCollectionSharder`` (position-weighted tables) and :class:`MCEBCSharder` /
    :class:`MCECSharder` (managed collision). A sharder in ``extra`` replaces the built-in one for its module type,
    and an ``extra`` EBC/EC sharder is also what the feature-processed and managed-collision sharders shard their
    tables with. An ``extra`` embedding sharder keeps every ``fused_params`` entry it sets and gets the others from
    ``fused_params``: the fused optimizer derived from ``configure_optimizers`` reaches it too (it is a copy: the
    user's sharder is left as it was). ``qcomms`` quantizes the built-in sharders' all-to-alls (an ``extra`` sharder
    keeps its own ``qcomm_codecs_registry``).

    Raises:
        ValueError: if an ``extra`` sharder sets an optimizer entry (``optimizer``, ``learning_rate``, ...) that
            differs from the one ``fused_params`` derives, naming both.
    """
    fused, codecs = dict(fused_params), qcomms_registry(qcomms)
    given = {s.module_type: _with_fused_params(s, fused, owner) for s in extra}
    ebc = given.get(EmbeddingBagCollection) or EBCSharder(fused_params=dict(fused), qcomm_codecs_registry=codecs)
    ec = given.get(EmbeddingCollection) or EmbeddingCollectionSharder(
        fused_params=dict(fused), qcomm_codecs_registry=codecs
    )
    built_in: list[ModuleSharder[nn.Module]] = [
        ebc,
        ec,
        FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder=ebc, qcomm_codecs_registry=codecs),
        MCEBCSharder(
            ebc_sharder=ebc,
            mc_sharder=ManagedCollisionCollectionSharder(),
            qcomm_codecs_registry=codecs,
        ),
        MCECSharder(
            ec_sharder=ec,
            mc_sharder=ManagedCollisionCollectionSharder(),
            qcomm_codecs_registry=codecs,
        ),
    ]
    by_type: dict[type, ModuleSharder[nn.Module]] = {s.module_type: s for s in built_in}
    by_type.update(given)
    return list(by_type.values())


def _with_fused_params(
    sharder: ModuleSharder[nn.Module], fused: Mapping[str, Any], owner: str
) -> ModuleSharder[nn.Module]:
    own = _compat.sharder_fused_params(sharder)
    if own is None:
        return sharder  # not an embedding sharder: nothing of ours to pass in
    conflicts = [k for k in _OPTIMIZER_KEYS if k in own and k in fused and own[k] != fused[k]]
    if conflicts:
        raise ValueError(
            f"{owner}: the sharder {type(sharder).__name__} sets the embedding optimizer "
            + ", ".join(f"{k}={own[k]!r}" for k in conflicts)
            + " in its fused_params, but the optimizer derived from `configure_optimizers` (or "
            "`configure_embedding_optimizer`) has "
            + ", ".join(f"{k}={fused[k]!r}" for k in conflicts)
            + ": the tables would not be trained the way the module says. HINT: leave the optimizer out of the "
            "sharder's fused_params (the strategy passes it in), or declare the same one in the module."
        )
    # TorchRec's own sharders become the ones that run row-wise on CPU too (a subclass, no other change): a user who
    # passes TorchRec's managed-collision sharder gets what TorchRec gives on CUDA, not "no available sharding type".
    upgrades: dict[type, type] = {
        EmbeddingBagCollectionSharder: EBCSharder,
        ManagedCollisionEmbeddingBagCollectionSharder: MCEBCSharder,
        ManagedCollisionEmbeddingCollectionSharder: MCECSharder,
    }
    return _compat.with_sharder_fused_params(sharder, {**fused, **own}, upgrades)


def plan_module(
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    *,
    module_types: Sequence[type[nn.Module]],
    constraints: Mapping[str, TableConstraints],
    topology: TopologyConfig | None,
    world_size: int,
    local_world_size: int,
    device_type: str,
    pg: dist.ProcessGroup | None,
    qcomms: QuantizedComms | None = None,
    preset: DevicePreset | None = None,
    batch_size: int | None = None,
) -> tuple[ShardingPlan, list | None]:
    """Plan every table of ``module`` (user constraints over the device defaults), on rank 0 when distributed.
    ``local_world_size``: ranks per host (the planner's intra- vs inter-host costs depend on it).

    Returns:
        the plan, and the planner's chosen sharding options with its estimates (``None`` where it did not plan).
    """
    planner = planner_for_module(
        module,
        module_types=module_types,
        constraints=constraints,
        topology=topology,
        world_size=world_size,
        local_world_size=local_world_size,
        device_type=device_type,
        qcomms=qcomms,
        preset=preset,
        batch_size=batch_size,
    )
    plan = plan_sharding(module, sharders, planner, pg)
    return plan, _compat.planner_sharding_options(planner)


def planner_for_module(
    module: nn.Module,
    *,
    module_types: Sequence[type[nn.Module]],
    constraints: Mapping[str, TableConstraints],
    topology: TopologyConfig | None,
    world_size: int,
    local_world_size: int,
    device_type: str,
    qcomms: QuantizedComms | None = None,
    preset: DevicePreset | None = None,
    batch_size: int | None = None,
) -> EmbeddingShardingPlanner:
    """The planner :func:`plan_module` plans ``module`` with (user constraints over the device defaults)."""
    tables = embedding_tables(module, module_types)
    return make_planner(
        world_size=world_size,
        device_type=device_type,
        topology=topology,
        local_world_size=local_world_size,
        constraints={**default_constraints(tables, device_type, qcomms), **constraints},
        preset=preset,
        batch_size=batch_size,
    )
