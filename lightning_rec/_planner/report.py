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
  from (:mod:`lightning_rec._planner.files`, ``RecShardStrategy(plan="plan.json")``).
- Imbalance, for memory and for cost: ``max / mean`` over ranks. 1.0 is perfectly even; on ``N`` ranks it is
  at most ``N`` (one rank carries everything). ``null`` when there are no estimates or they are all zero.

The estimates exist only where the planner ran: on rank 0 (TorchRec's ``collective_plan`` plans there and
broadcasts the plan, without its estimates), and not at all with a fixed ``plan=``. Without them the per-rank
numbers and the imbalance are ``null`` and ``estimates_available`` is ``false``.

The per-table rows and their text table: :mod:`lightning_rec._planner.table`; the per-rank estimates and
the imbalance: :mod:`lightning_rec._planner.estimates`; the picture: :mod:`lightning_rec._planner.chart`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchrec.distributed.types import ShardingPlan

from lightning_rec._planner.chart import draw_plan_chart
from lightning_rec._planner.constants import MIB
from lightning_rec._planner.estimates import RankEstimate, all_known, imbalance, rank_estimates
from lightning_rec._planner.table import PlanRow, format_rows, plan_rows

__all__ = [
    "PlanReport",
    "write_for_trainer",
    "write_plan_report",
]

JSON_NAME = "sharding_plan.json"
FORMAT = "lightning_rec.sharding_plan/1"  # the JSON document's name and version
PNG_NAME = "sharding_plan.png"


@dataclass
class PlanReport:
    """A sharding plan with the planner's per-rank estimates, as JSON, a PNG chart and a log table: what
    :func:`lightning_rec.plan_cluster` returns, what ``strategy.plan_report`` holds after ``setup``, and what
    ``RecShardStrategy(plan="plan.json")`` reads back.

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

        report = lightning_rec.plan_cluster(model, strategy.sharding, lightning_rec.Cluster(2, 8, preset="h100"))
        print(report.format_table())          # per table: sharding, ranks, shards; per rank: memory, cost, step
        report.max_memory_bytes, report.step_ms, report.imbalance
        report.write_json("plan.json")        # RecShardStrategy(plan="plan.json") trains with it
        report.write_png("plan.png")
        assert PlanReport.read_json("plan.json").to_dict() == report.to_dict()
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
            shapes: each table's ``[rows, cols]`` by name (see
                :func:`~lightning_rec._planner.table.table_shapes`), recorded so that a plan read back can be
                checked against a model.
            batch_size: the planner's per-rank batch size; preset: its device preset's name.
        """
        rows = plan_rows(plan, shapes)
        meta: dict[str, Any] = dict(local_world_size=local_world_size, batch_size=batch_size, preset=preset)
        if not sharding_options:
            return cls(world_size, device_type, rows, [RankEstimate(r) for r in range(world_size)], False, **meta)
        ranks = rank_estimates(sharding_options, world_size)
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
        values = all_known([r.memory_bytes for r in self.ranks])
        return max(values) if values else None

    @property
    def step_ms(self) -> float | None:
        """The planner's step time: the slowest rank's :attr:`RankEstimate.step_ms` (ranks wait for each other in
        the all-to-alls), or ``None`` without estimates."""
        values = all_known([r.step_ms for r in self.ranks])
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
                f"{r.rank:>4}  {(r.memory_bytes or 0) / MIB:>11.2f}  {(r.hbm_bytes or 0) / MIB:>10.2f}  "
                f"{(r.ddr_bytes or 0) / MIB:>10.2f}  {r.cost or 0.0:>9.4g}  {r.lookup_ms or 0.0:>11.4g}  "
                f"{r.input_dist_ms or 0.0:>14.4g}  {r.output_dist_ms or 0.0:>15.4g}  {r.step_ms or 0.0:>9.4g}"
            )
        lines.append(f"imbalance (max/mean over ranks): {self.imbalance_text()}")
        return "\n".join(lines)

    def write_png(self, path: os.PathLike[str] | str) -> None:
        """Draw memory and cost per rank as grouped bars on twin axes, titled with the imbalance.

        Needs matplotlib (imported here, drawn off-screen with the Agg canvas, so no display is touched).
        Without estimates it draws the number of table shards per rank instead (see
        :func:`~lightning_rec._planner.chart.draw_plan_chart`).
        """
        draw_plan_chart(self, path)

    def imbalance_text(self) -> str:
        """The imbalance for a log line or a title: ``"memory 1.20, cost 1.00"`` (``n/a`` without estimates)."""
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
