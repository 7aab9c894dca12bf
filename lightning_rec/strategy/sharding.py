"""From tables, topology and per-table constraints to a TorchRec ``ShardingPlan``.

The planner itself is TorchRec's ``EmbeddingShardingPlanner``; this module turns typed, YAML-friendly
configuration into its inputs and checks them against the model and device before any distributed work (the
resulting plan as a table people can read is :mod:`lightning_rec.strategy.plan_report`).
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Type

import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingType
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingConfig

from lightning_rec import _compat

# Re-exported from where they live now: the old paths keep working (the plan's rows belong to the report).
from lightning_rec.config import TableConstraints, TopologyConfig
from lightning_rec.strategy.plan_report import PlanRow as PlanRow, format_plan as format_plan
from lightning_rec.strategy.plan_report import format_rows as format_rows, plan_rows as plan_rows
from lightning_rec.tables import embedding_modules as embedding_modules  # re-exported: the old path
from lightning_rec.tables import embedding_tables

# What TorchRec can shard on each device (ROW_WISE/TABLE_ROW_WISE/GRID_SHARD need CUDA kernels).
_CPU_SHARDING_TYPES = (
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.DATA_PARALLEL.value,
)
_CUDA_SHARDING_TYPES = _CPU_SHARDING_TYPES + (
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.GRID_SHARD.value,
)
# Kernels that train (the quantised ones are inference-only); UVM kernels need CUDA.
_CPU_KERNELS = (EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value)
_CUDA_KERNELS = _CPU_KERNELS + (
    EmbeddingComputeKernel.FUSED_UVM.value,
    EmbeddingComputeKernel.FUSED_UVM_CACHING.value,
)


def supported_sharding_types(device_type: str, sequence: bool = False) -> Tuple[str, ...]:
    """Sharding types TorchRec can train with on ``device_type``.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        sequence: for a table of an ``EmbeddingCollection`` (unpooled). TorchRec 1.8's data-parallel
            ``EmbeddingCollection`` fails on CPU (its output lengths do not match its values), so it is left out.

    Example::

        >>> supported_sharding_types("cpu")
        ('table_wise', 'column_wise', 'table_column_wise', 'data_parallel')
    """
    types = _CUDA_SHARDING_TYPES if device_type == "cuda" else _CPU_SHARDING_TYPES
    if sequence and device_type != "cuda":
        types = tuple(t for t in types if t != ShardingType.DATA_PARALLEL.value)
    return types


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
    problems: List[str] = []
    unknown = sorted(set(constraints) - names)
    if unknown:
        problems.append(f"constraints name unknown tables {unknown}; the model's tables are {sorted(names)}")
    kernels_ok = _CUDA_KERNELS if device_type == "cuda" else _CPU_KERNELS
    for table, c in sorted(constraints.items()):
        types_ok = supported_sharding_types(device_type, isinstance(tables.get(table), EmbeddingConfig))
        for st in c.sharding_types or []:
            if st not in types_ok:
                problems.append(
                    f"table {table!r}: sharding type {st!r} cannot run on {device_type.upper()}; "
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


def default_constraints(tables: Mapping[str, BaseEmbeddingConfig], device_type: str) -> Dict[str, TableConstraints]:
    """Constraints that keep the planner to what ``device_type`` can run (TorchRec's planner would otherwise
    propose CUDA-only row-wise shardings on a CPU job)."""
    return {
        name: TableConstraints(
            sharding_types=list(supported_sharding_types(device_type, isinstance(c, EmbeddingConfig)))
        )
        for name, c in tables.items()
    }


def make_planner(
    *,
    world_size: int,
    device_type: str,
    topology: Optional[TopologyConfig],
    constraints: Mapping[str, TableConstraints],
    local_world_size: Optional[int] = None,
) -> EmbeddingShardingPlanner:
    """TorchRec's planner for this job: its topology (``world_size`` ranks, ``local_world_size`` of them per host,
    with ``topology`` overrides) and constraints.

    Args:
        local_world_size: ranks per host, as the launcher started them (the strategy passes its devices per
            node); ``topology.local_world_size`` overrides it; default: all ranks on one host.
    """
    topo = topology or TopologyConfig()
    local_world_size = topo.ranks_per_host(local_world_size or world_size)
    planner_topology = TopologyFactory.create_topology(
        TrainerConfig(
            world_size=world_size,
            local_world_size=local_world_size,
            hbm_cap_bytes=topo.hbm_cap,
            ddr_cap_bytes=topo.ddr_cap,
        ),
        kernel_config=KernelConfig(compute_device=device_type),
    )
    return EmbeddingShardingPlanner(
        topology=planner_topology,
        batch_size=topo.batch_size,
        # TorchRec's recommended reservation (its heuristic default warns that it over-estimates dense size).
        storage_reservation=FixedPercentageStorageReservation(percentage=0.15),
        constraints={name: c.to_torchrec() for name, c in constraints.items()},
        debug=False,
    )


def plan_sharding(
    module: nn.Module,
    sharders: List[ModuleSharder[nn.Module]],
    planner: EmbeddingShardingPlanner,
    pg: Optional[dist.ProcessGroup],
) -> ShardingPlan:
    """Plan on rank 0 and broadcast the result, so every rank shards identically."""
    if pg is not None and dist.is_initialized():
        return planner.collective_plan(module, sharders, pg)
    return planner.plan(module, sharders)


def make_sharders(
    fused_params: Mapping[str, object], extra: Sequence[ModuleSharder[nn.Module]] = ()
) -> List[ModuleSharder[nn.Module]]:
    """TorchRec's EBC and EC sharders with ``fused_params``; an ``extra`` sharder replaces the one for its type."""
    by_type: Dict[type, ModuleSharder[nn.Module]] = {
        s.module_type: s
        for s in (
            EmbeddingBagCollectionSharder(fused_params=dict(fused_params)),
            EmbeddingCollectionSharder(fused_params=dict(fused_params)),
        )
    }
    by_type.update({s.module_type: s for s in extra})
    return list(by_type.values())


def plan_module(
    module: nn.Module,
    sharders: List[ModuleSharder[nn.Module]],
    *,
    module_types: Sequence[Type[nn.Module]],
    constraints: Mapping[str, TableConstraints],
    topology: Optional[TopologyConfig],
    world_size: int,
    local_world_size: int,
    device_type: str,
    pg: Optional[dist.ProcessGroup],
) -> Tuple[ShardingPlan, Optional[list]]:
    """Plan every table of ``module`` (user constraints over the device defaults), on rank 0 when distributed.
    ``local_world_size``: ranks per host (the planner's intra- vs inter-host costs depend on it).

    Returns:
        the plan, and the planner's chosen sharding options with its estimates (``None`` where it did not plan).
    """
    tables = embedding_tables(module, module_types)
    planner = make_planner(
        world_size=world_size,
        device_type=device_type,
        topology=topology,
        local_world_size=local_world_size,
        constraints={**default_constraints(tables, device_type), **constraints},
    )
    plan = plan_sharding(module, sharders, planner, pg)
    return plan, _compat.planner_sharding_options(planner)
