"""TorchRec's planner asked one :class:`~lightning_rec._planner.request.PlanRequest`: one plan and its report out.

The planner itself is TorchRec's ``EmbeddingShardingPlanner`` (enumerate each table's sharding options, estimate
their memory and cost, partition them over the ranks). This module feeds it the request: the topology of
:mod:`lightning_rec._planner.topology`, the user's constraints over the device's defaults
(:mod:`lightning_rec._planner.devices`), the sharders with the fused optimizer
(:mod:`lightning_rec._planner.sharders`) and each table's optimizer state; plans on rank 0 and broadcasts when a
process group is given; and reads the result back as a :class:`~lightning_rec._planner.report.PlanReport`.

Example::

    request = sharding.request(TableInventory.of(model), EmbeddingOptimizer("adagrad", lr=0.1), world_size=2,
                               local_world_size=2, device_type="cpu")
    plan, report = make_plan(model, request)                    # no process group: planned here
    print(report.format_table())
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from lightning_rec import _compat
from lightning_rec._planner.constants import DEFAULT_BATCH_SIZE, STORAGE_RESERVATION
from lightning_rec._planner.devices import check_managed_collision
from lightning_rec._planner.files import check_plan
from lightning_rec._planner.report import PlanReport
from lightning_rec._planner.request import PlanRequest
from lightning_rec._planner.topology import DevicePreset, make_topology
from lightning_rec.config import TableConstraints, TopologyConfig

__all__ = [
    "asking_the_sharders",
    "make_plan",
    "make_planner",
    "plan_module",
    "plan_sharding",
    "planner_for",
    "table_storage_options",
]


def make_plan(
    module: nn.Module, request: PlanRequest, pg: dist.ProcessGroup | None = None
) -> tuple[ShardingPlan, PlanReport]:
    """The plan for ``request`` and its report: the managed-collision tables and a plan file checked against the
    request first, then the request's fixed plan, or TorchRec's planner (on rank 0 and broadcast when ``pg`` is a
    process group; here, with its estimates, without one: ``module``'s tables may sit on ``meta``).

    Raises:
        ValueError: a managed-collision table TorchRec cannot shard here, or a plan file made for another run.
        torchrec.distributed.planner.types.PlannerError: if the tables do not fit.
    """
    tables, ranks_per_host = request.tables, request.ranks_per_host
    check_managed_collision(
        module, tables.module_types, request.constraints, request.world_size, request.device_type, tables=tables
    )
    if request.plan_file is not None:
        check_plan(
            request.plan_file,
            module,
            tables.module_types,
            world_size=request.world_size,
            local_world_size=ranks_per_host,
            device_type=request.device_type,
            owner=request.owner,
            tables=tables,
        )
    if request.plan is not None:
        report = request.plan_file or PlanReport.from_plan(
            request.plan, request.world_size, request.device_type, None, ranks_per_host, shapes=tables.shapes
        )
        return request.plan, report
    plan, options = plan_module(module, request, pg)
    device = request.device
    report = PlanReport.from_plan(
        plan,
        request.world_size,
        request.device_type,
        options,
        ranks_per_host,
        shapes=tables.shapes,
        batch_size=request.batch,
        preset=device.name if device is not None else None,
    )
    return plan, report


def plan_module(
    module: nn.Module, request: PlanRequest, pg: dist.ProcessGroup | None = None
) -> tuple[ShardingPlan, list | None]:
    """Plan every table of ``module`` as ``request`` asks, on rank 0 when distributed.

    Returns:
        the plan, and the planner's chosen sharding options with its estimates (``None`` where it did not plan).
    """
    planner = planner_for(request)
    with asking_the_sharders(request):
        plan = plan_sharding(module, list(request.sharders), planner, pg)
    return plan, _compat.planner_sharding_options(planner)


def planner_for(request: PlanRequest) -> EmbeddingShardingPlanner:
    """TorchRec's planner for ``request``: its topology, batch size and constraints (the user's over the device
    defaults)."""
    return make_planner(
        world_size=request.world_size,
        device_type=request.device_type,
        topology=request.topology,
        local_world_size=request.ranks_per_host,
        constraints=request.all_constraints,
        preset=request.device,
        batch_size=request.batch,
    )


@contextlib.contextmanager
def asking_the_sharders(request: PlanRequest) -> Iterator[None]:
    """A context in which TorchRec's sharders and estimators see each table as ``request`` describes it: a table with
    a fused optimizer of its own carries its fused parameters, and each table's optimizer state is counted (both
    restored afterwards: nothing is left on the weights)."""
    with (
        _compat.table_fused_params(request.table_fused_params),
        _compat.optimizer_state_for_planner(request.optimizer_states),
    ):
        yield


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
        preset: the devices' memory and bandwidths (default: see :func:`~lightning_rec._planner.topology.default_preset`).
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
    batch = batch_size or topo.batch_size or DEFAULT_BATCH_SIZE
    torchrec_constraints = {name: c.to_torchrec() for name, c in constraints.items()}
    return EmbeddingShardingPlanner(
        topology=planner_topology,
        batch_size=batch,
        enumerator=_compat.ordered_enumerator(planner_topology, batch, torchrec_constraints),
        storage_reservation=FixedPercentageStorageReservation(percentage=STORAGE_RESERVATION),
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
