"""The sharding plan as rows and text: one :class:`PlanRow` per table, and the fixed-width table the log shows.

- :func:`plan_rows`: a ``ShardingPlan`` flattened to one row per table: sharding type, compute kernel, ranks, and
  each shard's rank, sizes ``[rows, cols]`` and offsets ``[row, col]`` (a ``data_parallel`` table has no shards:
  every rank holds a copy), with the whole table's shape (:func:`table_shapes`) and the plan's other settings
  (:func:`plan_extras`), so that a report can be read back as the plan it came from.
- :func:`format_rows` / :func:`format_plan`: those rows as a text table.

The per-rank estimates, the JSON document and the picture: :mod:`lightning_rec._planner.report`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from torchrec.distributed.types import ParameterSharding, ShardingPlan
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

__all__ = ["PlanRow", "format_plan", "format_rows", "plan_extras", "plan_rows", "table_shapes"]


@dataclass
class PlanRow:
    """One table of a plan, flattened for display.

    Args:
        module: path of the embedding module holding the table (``""``: the root module).
        table: the table name.
        sharding_type: e.g. ``"column_wise"``.
        compute_kernel: e.g. ``"fused"``.
        ranks: ranks holding (part of) the table.
        shard_sizes: ``[rows, cols]`` of each shard (empty for a replicated, ``data_parallel`` table).
        shard_offsets: ``[row, col]`` where each shard starts in the whole table.
        shard_ranks: the rank each shard is placed on (``None`` if the plan does not say).
        shard_placements: each shard's device, as TorchRec writes it (``"rank:1/cuda:1"``).
        shape: the whole table's ``[rows, cols]`` (``None``: not known where the report was built).
        extras: the plan's other per-table settings that are set (``cache_params``, ``enforce_hbm``,
            ``stochastic_rounding``, ``bounds_check_mode``, ``output_dtype``), as JSON values.
    """

    module: str
    table: str
    sharding_type: str
    compute_kernel: str
    ranks: list[int]
    shard_sizes: list[list[int]]
    shard_offsets: list[list[int]] = field(default_factory=list)
    shard_ranks: list[int | None] = field(default_factory=list)
    shard_placements: list[str] = field(default_factory=list)
    shape: list[int] | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def plan_rows(plan: ShardingPlan, shapes: Mapping[str, Sequence[int]] | None = None) -> list[PlanRow]:
    """The plan as one :class:`PlanRow` per table, in module then table order.

    Args:
        shapes: each table's ``[rows, cols]``, by table name (see :func:`table_shapes`).
    """
    rows = []
    for module_path, module_plan in plan.plan.items():
        for table, ps in module_plan.items():
            shards = getattr(ps.sharding_spec, "shards", None) or []
            rows.append(
                PlanRow(
                    module=module_path,
                    table=table,
                    sharding_type=ps.sharding_type,
                    compute_kernel=ps.compute_kernel,
                    ranks=list(ps.ranks or []),
                    shard_sizes=[list(s.shard_sizes) for s in shards],
                    shard_offsets=[list(s.shard_offsets) for s in shards],
                    shard_ranks=[s.placement.rank() if s.placement is not None else None for s in shards],
                    shard_placements=[str(s.placement) if s.placement is not None else "" for s in shards],
                    shape=list(shapes[table]) if shapes and table in shapes else None,
                    extras=plan_extras(ps),
                )
            )
    return rows


def table_shapes(tables: Mapping[str, BaseEmbeddingConfig]) -> dict[str, list[int]]:
    """``{table name: [num_embeddings, embedding_dim]}`` of table configs (e.g. ``tables`` of a :class:`lightning_rec._planner.inventory.TableInventory`)."""
    return {name: [c.num_embeddings, c.embedding_dim] for name, c in tables.items()}


_EXTRA_FIELDS = ("cache_params", "enforce_hbm", "stochastic_rounding", "bounds_check_mode", "output_dtype")


def plan_extras(ps: ParameterSharding) -> dict[str, Any]:
    """The settings of ``ps`` beyond type, kernel, ranks and shards that are set, as JSON values (enums by name,
    ``CacheParams`` as a dict); ``ParameterSharding.key_value_params`` (SSD tables) is not carried."""
    extras: dict[str, Any] = {}
    for name in _EXTRA_FIELDS:
        value = getattr(ps, name, None)
        if value is None:
            continue
        if isinstance(value, Enum):
            value = value.name
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {k: v.name if isinstance(v, Enum) else v for k, v in dataclasses.asdict(value).items()}
        extras[name] = value
    return extras


def format_plan(plan: ShardingPlan, world_size: int) -> str:
    """The plan as a fixed-width text table.

    Example::

        module  table    sharding     ranks  kernel  shards
        ebc     t_user   table_wise   0      fused   [100, 16]
        ebc     t_item   column_wise  0,1    fused   [200, 8] [200, 8]
    """
    return format_rows(plan_rows(plan), world_size)


def format_rows(rows: Sequence[PlanRow], world_size: int) -> str:
    """Rows (:class:`PlanRow`) as the fixed-width text table of :func:`format_plan`."""
    header = ("module", "table", "sharding", "ranks", "kernel", "shards")
    body = []
    for r in rows:
        ranks = ",".join(map(str, r.ranks)) if r.ranks else f"all {world_size}"
        shards = _shard_text(r.shard_sizes) if r.shard_sizes else "replicated"
        body.append((r.module or "<root>", r.table, r.sharding_type, ranks, r.compute_kernel, shards))
    if not body:
        return "(no embedding tables: the model is trained as plain data parallel)"
    widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in [header, *body]]
    return "\n".join(lines)


def _shard_text(sizes: Sequence[Sequence[int]]) -> str:
    """Shard sizes, equal neighbours counted: ``[[5, 4], [5, 4], [2, 4]]`` -> ``"2x[5, 4] [2, 4]"``."""
    groups: list[list[Any]] = []
    for size in sizes:
        if groups and groups[-1][1] == list(size):
            groups[-1][0] += 1
        else:
            groups.append([1, list(size)])
    return " ".join(f"{n}x{size}" if n > 1 else str(size) for n, size in groups)
