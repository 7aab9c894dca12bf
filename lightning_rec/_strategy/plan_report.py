"""The sharding-plan report: which table went where, and what the planner expects each rank to carry.

At fit start rank 0 logs it as a table and writes ``sharding_plan.json`` and ``sharding_plan.png`` next to the
logs (see :func:`write_for_trainer`).

- Per table (from the ``ShardingPlan``): sharding type, compute kernel, ranks, and each shard's rank, sizes
  ``[rows, cols]`` and offsets ``[row, col]``. A ``data_parallel`` table has no shards: every rank holds a copy.
- Per rank (the planner's estimates, summed over the table shards placed on that rank, as TorchRec's own
  ``EmbeddingStats`` does): memory in bytes, HBM (device) and DDR (host; what CPU training uses), and cost,
  ``Perf.total``: the modelled milliseconds per step of those shards' lookups and communication, split into
  lookups, the input all-to-all (not part of ``Perf.total``) and the output all-to-all; their sum is ``step_ms``.
  Dense layers are not included.
- The whole table's shape and each shard's placement, so that the document can be read back as the plan it came
  from (:mod:`lightning_rec._strategy.plan_file`, ``RecShardStrategy(plan="plan.json")``).
- Imbalance, for memory and for cost: ``max / mean`` over ranks. 1.0 is perfectly even; on ``N`` ranks it is
  at most ``N`` (one rank carries everything). ``null`` when there are no estimates or they are all zero.

The estimates exist only where the planner ran: on rank 0 (TorchRec's ``collective_plan`` plans there and
broadcasts the plan, without its estimates), and not at all with a fixed ``plan=``. Without them the per-rank
numbers and the imbalance are ``null`` and ``estimates_available`` is ``false``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar, cast

from torchrec.distributed.types import ParameterSharding, ShardingPlan
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

__all__ = [
    "PlanReport",
    "PlanRow",
    "RankEstimate",
    "format_plan",
    "format_rows",
    "plan_rows",
    "table_shapes",
    "write_for_trainer",
    "write_plan_report",
]

JSON_NAME = "sharding_plan.json"
FORMAT = "lightning_rec.sharding_plan/1"  # the JSON document's name and version
PNG_NAME = "sharding_plan.png"


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
    """``{table name: [num_embeddings, embedding_dim]}`` of table configs (e.g. :func:`lightning_rec._tables.embedding_tables`)."""
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


@dataclass
class RankEstimate:
    """The planner's totals for one rank (``None``: no estimate).

    Args:
        rank: the global rank.
        hbm_bytes: device memory of the table shards placed there.
        ddr_bytes: host memory of the table shards placed there.
        cost: modelled milliseconds per step (``Perf.total``, what the planner balances) of those shards.
        lookup_ms: of ``cost``, the lookups' forward and backward (``fwd_compute + bwd_compute + prefetch_compute``).
        input_dist_ms: the ids' input all-to-all (``Perf.input_dist_comms``; not part of ``cost``).
        output_dist_ms: of ``cost``, the embeddings' output all-to-all and its gradient's
            (``fwd_comms + bwd_comms``).

    Example::

        >>> RankEstimate(rank=0, hbm_bytes=0, ddr_bytes=4096, cost=0.2).memory_bytes
        4096
        >>> RankEstimate(0, lookup_ms=1.0, input_dist_ms=0.5, output_dist_ms=2.0).step_ms
        3.5
    """

    rank: int
    hbm_bytes: int | None = None
    ddr_bytes: int | None = None
    cost: float | None = None
    lookup_ms: float | None = None
    input_dist_ms: float | None = None
    output_dist_ms: float | None = None

    @property
    def step_ms(self) -> float | None:
        """The planner's milliseconds per step of this rank's tables: lookups, input and output all-to-alls."""
        parts = _all_known((self.lookup_ms, self.input_dist_ms, self.output_dist_ms))
        return None if parts is None else sum(parts)

    @property
    def memory_bytes(self) -> int | None:
        """HBM plus DDR bytes, or ``None`` without an estimate."""
        if self.hbm_bytes is None or self.ddr_bytes is None:
            return None
        return self.hbm_bytes + self.ddr_bytes

    def to_dict(self) -> dict[str, Any]:
        """``{"rank", "hbm_bytes", "ddr_bytes", "memory_bytes", "cost", "lookup_ms", "input_dist_ms",
        "output_dist_ms", "step_ms"}``."""
        return {
            "rank": self.rank,
            "hbm_bytes": self.hbm_bytes,
            "ddr_bytes": self.ddr_bytes,
            "memory_bytes": self.memory_bytes,
            "cost": self.cost,
            "lookup_ms": self.lookup_ms,
            "input_dist_ms": self.input_dist_ms,
            "output_dist_ms": self.output_dist_ms,
            "step_ms": self.step_ms,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> RankEstimate:
        """The inverse of :meth:`to_dict` (derived keys are ignored)."""
        keys = ("hbm_bytes", "ddr_bytes", "cost", "lookup_ms", "input_dist_ms", "output_dist_ms")
        return cls(int(doc["rank"]), **{k: doc.get(k) for k in keys})


def imbalance(values: Sequence[float | None]) -> float | None:
    """``max / mean`` of per-rank ``values``: 1.0 is even, ``len(values)`` is one rank carrying everything.

    Returns:
        ``None`` if any value is missing or the mean is not positive.

    Example::

        >>> imbalance([3.0, 1.0])
        1.5
        >>> imbalance([2.0, 2.0]), imbalance([None, 1.0]), imbalance([0, 0])
        (1.0, None, None)
    """
    known = _all_known(values)
    if not known:
        return None
    mean = sum(known) / len(known)
    return max(known) / mean if mean > 0 else None


_T = TypeVar("_T")


def _all_known(values: Sequence[_T | None]) -> list[_T] | None:
    """``values`` as a list, or ``None`` if any of them is ``None``."""
    known = [v for v in values if v is not None]
    return known if len(known) == len(values) else None


@dataclass
class PlanReport:
    """A sharding plan with the planner's per-rank estimates, as JSON, a PNG chart and a log table.

    Args:
        world_size: number of ranks.
        device_type: ``"cpu"`` or ``"cuda"``.
        tables: one :class:`PlanRow` per table.
        ranks: one :class:`RankEstimate` per rank (its numbers ``None`` without estimates).
        estimates_available: whether ``ranks`` carries the planner's estimates.
        local_world_size: ranks per host the planner assumed (``None``: not recorded).
        batch_size: per-rank batch size of the planner's cost model (``None``: not recorded).
        preset: the device preset whose memory and bandwidths the planner assumed (``None``: TorchRec's defaults).

    Example::

        planner = make_planner(world_size=2, device_type="cpu", topology=None, constraints={})
        plan = planner.plan(ebc, make_sharders({}))
        report = PlanReport.from_plan(plan, 2, "cpu", _compat.planner_sharding_options(planner))
        print(report.format_table())
        report.write_json("sharding_plan.json")
        report.write_png("sharding_plan.png")
    """

    world_size: int
    device_type: str
    tables: list[PlanRow]
    ranks: list[RankEstimate]
    estimates_available: bool = False
    local_world_size: int | None = None
    batch_size: int | None = None
    preset: str | None = None

    @classmethod
    def from_plan(
        cls,
        plan: ShardingPlan,
        world_size: int,
        device_type: str,
        sharding_options: Sequence[Any] | None = None,
        local_world_size: int | None = None,
        *,
        shapes: Mapping[str, Sequence[int]] | None = None,
        batch_size: int | None = None,
        preset: str | None = None,
    ) -> PlanReport:
        """Build the report from ``plan`` and, when the planner ran here, its chosen ``ShardingOption``\\ s.

        Args:
            plan: the plan the model is sharded with.
            world_size: number of ranks.
            device_type: ``"cpu"`` or ``"cuda"``.
            sharding_options: the planner's chosen options, whose shards carry ``rank``, ``storage`` and
                ``perf`` (see ``lightning_rec._compat.planner_sharding_options``); ``None``: no estimates.
            local_world_size: ranks per host the planner was told.
            shapes: each table's ``[rows, cols]`` by name (see :func:`table_shapes`), recorded so that a plan
                read back can be checked against a model.
            batch_size: the planner's per-rank batch size; preset: its device preset's name.
        """
        rows = plan_rows(plan, shapes)
        meta: dict[str, Any] = dict(local_world_size=local_world_size, batch_size=batch_size, preset=preset)
        if not sharding_options:
            return cls(world_size, device_type, rows, [RankEstimate(r) for r in range(world_size)], False, **meta)
        ranks = [RankEstimate(r, 0, 0, 0.0, 0.0, 0.0, 0.0) for r in range(world_size)]
        for option in sharding_options:
            for shard in option.shards:
                if shard.rank is None or not 0 <= shard.rank < world_size:
                    continue
                total = ranks[shard.rank]
                if shard.storage is not None:
                    total.hbm_bytes += int(shard.storage.hbm)
                    total.ddr_bytes += int(shard.storage.ddr)
                if shard.perf is not None:
                    perf = shard.perf
                    total.cost += float(perf.total)
                    total.lookup_ms += float(perf.fwd_compute + perf.bwd_compute + perf.prefetch_compute)
                    total.input_dist_ms += float(getattr(perf, "input_dist_comms", 0.0))
                    total.output_dist_ms += float(perf.fwd_comms + perf.bwd_comms)
        return cls(world_size, device_type, rows, ranks, True, **meta)

    @property
    def num_hosts(self) -> int | None:
        """Hosts (nodes) the ranks are spread over, as the planner saw them."""
        return -(-self.world_size // self.local_world_size) if self.local_world_size else None

    @property
    def imbalance(self) -> dict[str, float | None]:
        """``{"memory": max/mean, "cost": max/mean}`` over ranks (see :func:`imbalance`)."""
        return {
            "memory": imbalance([r.memory_bytes for r in self.ranks]),
            "cost": imbalance([r.cost for r in self.ranks]),
        }

    @property
    def max_memory_bytes(self) -> int | None:
        """The fullest rank's estimated memory (HBM + DDR), or ``None`` without estimates."""
        values = _all_known([r.memory_bytes for r in self.ranks])
        return max(values) if values else None

    @property
    def step_ms(self) -> float | None:
        """The planner's step time: the slowest rank's :attr:`RankEstimate.step_ms` (ranks wait for each other in
        the all-to-alls), or ``None`` without estimates."""
        values = _all_known([r.step_ms for r in self.ranks])
        return max(values) if values else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON document.

        Example::

            {"world_size": 2, "local_world_size": 2, "num_hosts": 1, "device_type": "cpu", "estimates_available": true,
             "tables": [{"name": "t_user", "module": "ebc", "sharding_type": "column_wise",
                         "compute_kernel": "fused", "ranks": [0, 1],
                         "shards": [{"rank": 0, "sizes": [60, 4], "offsets": [0, 0]},
                                    {"rank": 1, "sizes": [60, 4], "offsets": [0, 4]}]}, ...],
             "ranks": [{"rank": 0, "hbm_bytes": 0, "ddr_bytes": 5376, "memory_bytes": 5376, "cost": 0.08}, ...],
             "imbalance": {"memory": 1.2, "cost": 1.0}, "imbalance_definition": "max / mean over ranks"}

        ``cost`` is in milliseconds per step (the planner's ``Perf.total``); byte counts are integers.
        """
        return {
            "format": FORMAT,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "num_hosts": self.num_hosts,
            "device_type": self.device_type,
            "preset": self.preset,
            "batch_size": self.batch_size,
            "estimates_available": self.estimates_available,
            "tables": [
                {
                    "name": t.table,
                    "module": t.module,
                    "shape": t.shape,
                    "sharding_type": t.sharding_type,
                    "compute_kernel": t.compute_kernel,
                    "ranks": t.ranks,
                    "shards": [
                        {"rank": r, "sizes": s, "offsets": o, "placement": p}
                        for r, s, o, p in zip(
                            t.shard_ranks,
                            t.shard_sizes,
                            t.shard_offsets,
                            t.shard_placements or [""] * len(t.shard_sizes),
                        )
                    ],
                    **({"extras": t.extras} if t.extras else {}),
                }
                for t in self.tables
            ],
            "ranks": [r.to_dict() for r in self.ranks],
            "step_ms": self.step_ms,
            "max_memory_bytes": self.max_memory_bytes,
            "imbalance": self.imbalance,
            "imbalance_definition": "max / mean over ranks",
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> PlanReport:
        """The report :meth:`to_dict` wrote (``sharding_plan.json`` of a ``fit``, ``plan.json`` of
        ``lightning-rec plan``).

        Raises:
            ValueError: if ``doc`` is not such a report, naming what is missing.
        """
        missing = [k for k in ("world_size", "device_type", "tables") if k not in doc]
        if missing:
            raise ValueError(
                f"not a sharding-plan report: it has no {', '.join(missing)}. HINT: pass the plan.json that "
                "`lightning-rec plan` wrote, or the sharding_plan.json of a fit."
            )
        tables = []
        for t in doc["tables"]:
            shards = t.get("shards") or []
            tables.append(
                PlanRow(
                    module=t["module"],
                    table=t["name"],
                    sharding_type=t["sharding_type"],
                    compute_kernel=t["compute_kernel"],
                    ranks=list(t.get("ranks") or []),
                    shard_sizes=[list(s["sizes"]) for s in shards],
                    shard_offsets=[list(s["offsets"]) for s in shards],
                    shard_ranks=[s.get("rank") for s in shards],
                    shard_placements=[s.get("placement") or "" for s in shards],
                    shape=t.get("shape"),
                    extras=dict(t.get("extras") or {}),
                )
            )
        return cls(
            world_size=int(doc["world_size"]),
            device_type=doc["device_type"],
            tables=tables,
            ranks=[RankEstimate.from_dict(r) for r in doc.get("ranks") or []],
            estimates_available=bool(doc.get("estimates_available")),
            local_world_size=doc.get("local_world_size"),
            batch_size=doc.get("batch_size"),
            preset=doc.get("preset"),
        )

    @classmethod
    def read_json(cls, path: os.PathLike[str] | str) -> PlanReport:
        """Read a report :meth:`write_json` wrote.

        Raises:
            ValueError: if the file is not JSON or not such a report, naming the file.
        """
        try:
            with open(path) as f:
                doc = json.load(f)
            return cls.from_dict(doc)
        except (json.JSONDecodeError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{os.fspath(path)!r} is not a sharding plan: {type(err).__name__}: {err}") from None

    def write_json(self, path: os.PathLike[str] | str) -> None:
        """Write :meth:`to_dict` to ``path`` (indented JSON)."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    def format_table(self) -> str:
        """The per-table plan, then the per-rank estimates and imbalance, as fixed-width text (for the log).

        Example::

            module  table   sharding       ranks  kernel  shards
            ebc     t_user  column_wise    0,1    fused   [60, 4] [60, 4]
            ebc     t_item  table_wise     1      fused   [80, 8]
            ebc     t_genre data_parallel  0,1    dense   replicated
            rank  memory (MB)  HBM (MB)  DDR (MB)  cost (ms)
               0         0.01      0.00      0.01      0.08
               1         0.01      0.00      0.01      0.08
            imbalance (max/mean over ranks): memory 1.20, cost 1.00
        """
        lines = [format_rows(self.tables, self.world_size)]
        if not self.estimates_available:
            lines.append("(planner estimates unavailable: the plan was given, or this rank did not plan)")
            return "\n".join(lines)
        lines.append(
            f"{'rank':>4}  {'memory (MB)':>11}  {'HBM (MB)':>10}  {'DDR (MB)':>10}  {'cost (ms)':>9}  "
            f"{'lookup (ms)':>11}  {'input a2a (ms)':>14}  {'output a2a (ms)':>15}  {'step (ms)':>9}"
        )
        for r in self.ranks:
            lines.append(
                f"{r.rank:>4}  {(r.memory_bytes or 0) / 2**20:>11.2f}  {(r.hbm_bytes or 0) / 2**20:>10.2f}  "
                f"{(r.ddr_bytes or 0) / 2**20:>10.2f}  {r.cost or 0.0:>9.4g}  {r.lookup_ms or 0.0:>11.4g}  "
                f"{r.input_dist_ms or 0.0:>14.4g}  {r.output_dist_ms or 0.0:>15.4g}  {r.step_ms or 0.0:>9.4g}"
            )
        lines.append(f"imbalance (max/mean over ranks): {self._imbalance_text()}")
        return "\n".join(lines)

    def write_png(self, path: os.PathLike[str] | str) -> None:
        """Draw memory and cost per rank as grouped bars on twin axes, titled with the imbalance.

        Needs matplotlib (imported here, drawn off-screen with the Agg canvas, so no display is touched).
        Without estimates it draws the number of table shards per rank instead.
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        fig = Figure(figsize=(max(5.0, 0.9 * self.world_size + 3.0), 3.8), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        xs = list(range(self.world_size))
        if self.estimates_available:
            width = 0.38
            mem_mb = [(r.memory_bytes or 0) / 2**20 for r in self.ranks]
            cost = [r.cost or 0.0 for r in self.ranks]
            bars = ax.bar([x - width / 2 for x in xs], mem_mb, width, label="memory (MB)", color="tab:blue")
            twin = ax.twinx()
            bars2 = twin.bar([x + width / 2 for x in xs], cost, width, label="cost (ms/step)", color="tab:orange")
            # Headroom above the bars for the legend.
            ax.set_ylim(0, 1.3 * max(mem_mb + [1e-9]))
            twin.set_ylim(0, 1.3 * max(cost + [1e-9]))
            ax.set_ylabel("memory (MB)")
            twin.set_ylabel("planner cost (ms/step)")
            ax.legend(handles=[bars, bars2], loc="upper center", ncol=2, fontsize=8, framealpha=0.9)
            subtitle = f"imbalance (max/mean over ranks): {self._imbalance_text()}"
        else:
            shards = [sum(r in t.shard_ranks or (not t.shard_ranks and r in t.ranks) for t in self.tables) for r in xs]
            ax.bar(xs, shards, color="tab:blue")
            ax.set_ylabel("tables with a shard here")
            # a bar chart's y axis keeps its default AutoLocator, a MaxNLocator (matplotlib types it as a Locator)
            cast(MaxNLocator, ax.yaxis.get_major_locator()).set_params(integer=True)
            subtitle = "planner estimates unavailable: tables per rank"
        ax.set_title(f"Sharding plan: {self.world_size} rank(s), {self.device_type}\n{subtitle}", fontsize=9)
        ax.set_xticks(xs)
        ax.set_xlabel("rank")
        fig.tight_layout()
        fig.savefig(path, format="png")

    def _imbalance_text(self) -> str:
        imb = self.imbalance
        return ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}'}" for k, v in imb.items())


def write_plan_report(report: PlanReport, directory: os.PathLike[str] | str) -> str | None:
    """Write ``sharding_plan.json`` and ``sharding_plan.png`` into ``directory`` (created if missing).

    A failure (read-only directory, matplotlib missing) warns and never stops training.

    Returns:
        the directory written to, or ``None`` if writing failed.

    Example::

        write_plan_report(report, "lightning_logs/version_0")
    """
    from lightning.pytorch.utilities import rank_zero_warn

    out = os.fspath(directory)
    try:
        os.makedirs(out, exist_ok=True)
        report.write_json(os.path.join(out, JSON_NAME))
        report.write_png(os.path.join(out, PNG_NAME))
    except Exception as e:  # noqa: BLE001 - a report must never cost a training run
        rank_zero_warn(
            f"RecShardStrategy could not write the sharding-plan report to {out!r}: {type(e).__name__}: {e}. "
            "Training goes on. HINT: make the log directory writable and `pip install matplotlib`, or pass "
            "`RecShardStrategy(report_plan=False)`."
        )
        return None
    return out


def write_for_trainer(report: PlanReport, trainer: Any, global_rank: int) -> str | None:
    """Write the report where ``trainer``'s logs go: the first logger's ``log_dir`` (e.g.
    ``lightning_logs/version_0``, via ``trainer.log_dir``). Without a logger (``logger=False``), or with one that
    has no directory, nothing is written: the plan is only logged as a table. Call it on every rank:
    ``trainer.log_dir`` broadcasts from rank 0, so every rank must ask; only rank 0 writes.

    Returns:
        the directory rank 0 wrote to (``None`` on other ranks, without a log directory, or if writing failed).
    """
    if not trainer.loggers:
        return None  # `trainer.log_dir` would fall back to `default_root_dir`: a place nobody asked for the files
    log_dir = trainer.log_dir
    return write_plan_report(report, log_dir) if global_rank == 0 and log_dir else None
