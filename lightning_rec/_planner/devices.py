"""What TorchRec and FBGEMM can train on each device, and the refusals that name what cannot, before anything is
sharded: sharding types and kernels per device (:func:`supported_sharding_types`, :func:`supported_kernels`), the
user's constraints (:func:`validate_constraints`), quantized comms (:func:`check_qcomms`), managed-collision tables
(:func:`check_managed_collision`) and variable-batch inputs (:func:`vbe_refusals`). Found by trying each on CPU; the
sharders and the planner that use it are :mod:`lightning_rec._planner.sharders` and
:mod:`lightning_rec._planner.planner`.

Example::

    validate_constraints({"t_user": TableConstraints(sharding_types=["row_wise"])}, tables, "cpu")
    supported_kernels("cpu")   # ('fused', 'dense')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingConfig
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

from lightning_rec import _compat
from lightning_rec._planner.inventory import TableInventory
from lightning_rec.config import _OPTIMIZER_FACTS, QuantizedComms, TableConstraints

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


def kernels_on(kernels: list[str], compute_device_type: str) -> list[str]:
    """``kernels`` less those that cannot train on ``compute_device_type``: a managed-collision sharder lists FBGEMM's
    UVM and key-value kernels on every device; on CPU only ``fused`` runs (TorchRec's CPU planner otherwise picks
    ``fused_uvm``)."""
    return kernels if compute_device_type == "cuda" else [k for k in kernels if k in _CPU_KERNELS]


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
        tables: the model's tables by name (``tables`` of a :class:`~lightning_rec._planner.inventory.TableInventory`).
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
    tables: TableInventory | None = None,
) -> None:
    """Refuse managed-collision modules TorchRec cannot shard here, before any planning, naming the table and why.

    TorchRec shards a managed-collision table row-wise only, each rank owning a block of its raw id space and of its
    rows; the collision module's ``buckets`` must split evenly over the ranks. Its hash-based
    ``HashZchManagedCollisionModule`` trains on CUDA only (FBGEMM's CPU kernel is read-only). A collision module left
    at the default ``input_hash_size`` (2**63 - 1) is warned about on several ranks: ids are routed to a rank by
    their block of that space, so every realistic id lands on rank 0 and the other ranks' rows stay unused.

    Args:
        tables: ``module``'s inventory, when the caller took it already (default: taken here).

    Raises:
        ValueError: naming every problem.
    """
    from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule

    problems, default_space = [], []
    for path, sub in (tables or TableInventory.of(module, module_types)).modules.items():
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
_VBE_OPTIMIZERS = tuple(name for name, f in _OPTIMIZER_FACTS.items() if f.variable_batch)
# On CPU TorchRec 1.8 fails on VBE inputs of data-parallel tables (its lookup splits them wrongly), and on several
# gloo ranks on grid-sharded ones (`IndexError: Dimension out of range` in its output distribution). Row-wise and
# table-row-wise ones train exactly on several gloo ranks since their gradients' unequal all-gather is padded
# (strategy/uneven_batches.py; tests/strategy/test_torchrec_models.py). Found by trying each.
_VBE_CPU_UNSUPPORTED = (ShardingType.DATA_PARALLEL.value,)
_VBE_GLOO_UNSUPPORTED = (ShardingType.GRID_SHARD.value,)


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
                    f"grid-sharded ones: {', '.join(odd)}"
                )
        if reasons:
            refusals[path] = "; ".join(reasons)
    return refusals


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
