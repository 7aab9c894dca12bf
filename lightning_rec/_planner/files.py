"""A sharding plan from disk: the ``plan.json`` of ``lightning-rec plan`` (or the ``sharding_plan.json`` a ``fit``
wrote) turned back into TorchRec's ``ShardingPlan``, and checked against the run that is about to use it before
anything is sharded.

Example::

    report = read_plan("plans/criteo_2x8/plan.json")
    check_plan(report, model, module_types, world_size=16, local_world_size=8, device_type="cuda")
    plan = to_sharding_plan(report)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn
from torchrec.distributed.planner.utils import placement
from torchrec.distributed.types import (
    BoundsCheckMode,
    CacheAlgorithm,
    CacheParams,
    DataType,
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ParameterSharding,
    ShardingPlan,
    ShardMetadata,
)
from torchrec.modules.embedding_configs import EmbeddingConfig

from lightning_rec._planner.devices import supported_kernels, supported_sharding_types
from lightning_rec._planner.inventory import TableInventory
from lightning_rec._planner.report import PlanReport
from lightning_rec._planner.table import PlanRow

__all__ = ["check_plan", "read_plan", "to_sharding_plan"]


def read_plan(path: os.PathLike[str] | str, owner: str = "RecShardStrategy") -> PlanReport:
    """The plan report at ``path``.

    Raises:
        ValueError: if there is no such file, or it is not a plan report, naming the path.
    """
    if not os.path.isfile(path):
        raise ValueError(
            f"{owner}(plan={os.fspath(path)!r}): no such file. HINT: write one with `lightning-rec plan --config "
            "CONFIG.yaml --hosts H --devices-per-host D --output DIR` and pass DIR/plan.json."
        )
    try:
        return PlanReport.read_json(path)
    except ValueError as err:
        raise ValueError(f"{owner}(plan=...): {err}") from None


def to_sharding_plan(report: PlanReport) -> ShardingPlan:
    """TorchRec's ``ShardingPlan`` the report describes (the one it was made from, field for field).

    Example::

        plan = to_sharding_plan(PlanReport.read_json("plan.json"))
        DistributedModelParallel(model, plan=plan, ...)
    """
    local = report.local_world_size or report.world_size
    plan: dict[str, EmbeddingModuleShardingPlan] = {}
    for row in report.tables:
        spec = None
        if row.shard_sizes:
            spec = EnumerableShardingSpec(
                [
                    ShardMetadata(
                        shard_offsets=list(offsets),
                        shard_sizes=list(sizes),
                        placement=where or placement(report.device_type, rank, local),
                    )
                    for sizes, offsets, rank, where in zip(
                        row.shard_sizes, row.shard_offsets, _shard_ranks(row), _placements(row)
                    )
                ]
            )
        module_plan = plan.setdefault(row.module, EmbeddingModuleShardingPlan())
        module_plan[row.table] = ParameterSharding(
            sharding_type=row.sharding_type,
            compute_kernel=row.compute_kernel,
            ranks=list(row.ranks) if row.ranks else None,
            sharding_spec=spec,
            **_decode_extras(row.extras),
        )
    return ShardingPlan(plan)


def check_plan(
    report: PlanReport,
    module: nn.Module,
    module_types: Sequence[type[nn.Module]],
    *,
    world_size: int,
    local_world_size: int,
    device_type: str,
    owner: str = "RecShardStrategy",
    tables: TableInventory | None = None,
) -> None:
    """Refuse a plan made for another run: another world size, ranks per host or device type, other tables or
    table shapes, or a sharding type or kernel this device cannot train with.

    Args:
        tables: ``module``'s inventory, when the caller took it already (default: taken here).

    Raises:
        ValueError: naming every mismatch, what the plan says and what the run has.
    """
    problems: list[str] = []
    if report.world_size != world_size:
        problems.append(f"it is for {report.world_size} rank(s), this run has {world_size}")
    if report.local_world_size is not None and report.local_world_size != local_world_size:
        problems.append(f"it puts {report.local_world_size} rank(s) on a host, this run {local_world_size}")
    if report.device_type != device_type:
        problems.append(f"it is for {report.device_type}, this run is on {device_type}")

    model_tables = (tables or TableInventory.of(module, module_types)).placed
    planned = {(row.module, row.table): row for row in report.tables}
    missing, extra = sorted(set(model_tables) - set(planned)), sorted(set(planned) - set(model_tables))
    missing_at = {name: path for path, name in missing}
    moved = {name: (path, missing_at[name]) for path, name in extra if name in missing_at}
    if moved:  # the same tables under another module path: a plan of the inner model given to the LightningModule
        problems.append(
            f"its tables {sorted(moved)} sit under "
            + ", ".join(sorted({f"{p or '<root>'!r}" for p, _ in moved.values()}))
            + " in the plan, under "
            + ", ".join(sorted({f"{m or '<root>'!r}" for _, m in moved.values()}))
            + " in the model (plan the module you train)"
        )
    for path, name in missing:
        if name not in moved:
            problems.append(f"it has no table {name!r} (of {path or '<root>'!r}), which the model has")
    for path, name in extra:
        if name not in moved:
            problems.append(f"it plans a table {name!r} (of {path or '<root>'!r}), which the model does not have")
    for key in sorted(set(planned) & set(model_tables)):
        row, config = planned[key], model_tables[key]
        shape = row.shape or _covered_shape(row)
        if shape is not None and list(shape) != [config.num_embeddings, config.embedding_dim]:
            problems.append(
                f"table {key[1]!r} is {list(shape)} in the plan, [{config.num_embeddings}, {config.embedding_dim}] "
                "in the model"
            )
        sequence = isinstance(config, EmbeddingConfig)
        if row.sharding_type not in supported_sharding_types(device_type, sequence):
            problems.append(
                f"table {key[1]!r} is {row.sharding_type}, which {device_type} cannot train "
                f"(it can: {', '.join(supported_sharding_types(device_type, sequence))})"
            )
        if row.compute_kernel not in supported_kernels(device_type):
            problems.append(
                f"table {key[1]!r} uses the {row.compute_kernel!r} kernel, which {device_type} cannot train "
                f"(it can: {', '.join(supported_kernels(device_type))})"
            )
    if problems:
        raise ValueError(
            f"{owner}: the given plan does not fit this run: "
            + "; ".join(problems)
            + ". HINT: make the plan for this run's shape (`lightning-rec plan --hosts H --devices-per-host D "
            "--device-type cpu|cuda` with this config), or leave `plan` unset to let the planner plan at start."
        )


def _shard_ranks(row: PlanRow) -> list[Any]:
    return list(row.shard_ranks) if row.shard_ranks else [None] * len(row.shard_sizes)


def _placements(row: PlanRow) -> list[str]:
    return list(row.shard_placements) if row.shard_placements else [""] * len(row.shard_sizes)


def _covered_shape(row: PlanRow) -> list[int] | None:
    """The table's shape as its shards cover it (``None`` without shards)."""
    if not row.shard_sizes:
        return None
    return [max(o[i] + s[i] for s, o in zip(row.shard_sizes, row.shard_offsets)) for i in (0, 1)]


def _decode_extras(extras: Mapping[str, Any]) -> dict[str, Any]:
    """``ParameterSharding`` keyword arguments from the report's JSON ``extras`` (see :func:`lightning_rec._planner.table.plan_extras`)."""
    out: dict[str, Any] = {}
    for name, value in extras.items():
        if name == "bounds_check_mode":
            value = BoundsCheckMode[value]
        elif name == "output_dtype":
            value = DataType[value]
        elif name == "cache_params":
            value = CacheParams(
                **{k: CacheAlgorithm[v] if k == "algorithm" and v is not None else v for k, v in value.items()}
            )
        out[name] = value
    return out
