"""The sharding-plan report: which table went where, and what the planner expects each rank to carry.

At fit start rank 0 logs it as a table and writes ``sharding_plan.json`` and ``sharding_plan.png`` next to the
logs. Per table: sharding type, compute kernel, ranks, shard sizes and offsets (from the ``ShardingPlan``). Per
rank: the planner's estimates of memory (HBM = device, DDR = host bytes) and cost (``Perf.total``, its
modelled time per step), summed over the shards placed there, plus the imbalance between ranks, defined as
``max / mean`` over ranks (1.0 = perfectly even; 2.0 on two ranks = one rank does everything).
Estimates exist only on the rank that ran the planner and only when it ran (not with a fixed ``plan=``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from torchrec.distributed.types import ShardingPlan

from lightning_rec.sharding import PlanRow, format_rows, plan_rows

__all__ = ["PlanReport", "RankEstimate", "write_plan_report"]


@dataclass
class RankEstimate:
    """The planner's totals for one rank."""

    rank: int
    hbm_bytes: int
    ddr_bytes: int
    cost: float

    @property
    def memory_bytes(self) -> int:
        return self.hbm_bytes + self.ddr_bytes


def _imbalance(values: Sequence[float]) -> Optional[float]:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else None


@dataclass
class PlanReport:
    """A sharding plan with the planner's per-rank estimates.

    Example::

        report = PlanReport.from_plan(strategy.sharding_plan, world_size=2, device_type="cpu",
                                      sharding_options=chosen_options)   # options: optional
        print(report.format_table())
        report.write_json("sharding_plan.json"); report.write_png("sharding_plan.png")
    """

    world_size: int
    device_type: str
    tables: List[PlanRow]
    ranks: Optional[List[RankEstimate]] = None

    @classmethod
    def from_plan(
        cls, plan: ShardingPlan, world_size: int, device_type: str, sharding_options: Optional[Sequence[Any]] = None
    ) -> "PlanReport":
        """Build the report; ``sharding_options`` are the planner's chosen ``ShardingOption``s (with estimates)."""
        ranks = None
        if sharding_options:
            totals = {r: RankEstimate(r, 0, 0, 0.0) for r in range(world_size)}
            for option in sharding_options:
                for shard in option.shards:
                    if shard.rank is None or shard.rank not in totals:
                        continue
                    t = totals[shard.rank]
                    if shard.storage is not None:
                        t.hbm_bytes += int(shard.storage.hbm)
                        t.ddr_bytes += int(shard.storage.ddr)
                    if shard.perf is not None:
                        t.cost += float(shard.perf.total)
            ranks = [totals[r] for r in range(world_size)]
        return cls(world_size=world_size, device_type=device_type, tables=plan_rows(plan), ranks=ranks)

    @property
    def imbalance(self) -> Dict[str, Optional[float]]:
        """``{"memory": max/mean, "cost": max/mean}`` over ranks (``None`` without estimates)."""
        if not self.ranks:
            return {"memory": None, "cost": None}
        return {
            "memory": _imbalance([r.memory_bytes for r in self.ranks]),
            "cost": _imbalance([r.cost for r in self.ranks]),
        }

    def to_dict(self) -> Dict[str, Any]:
        """The JSON document: world_size, device_type, tables, ranks (or null), imbalance."""
        return {
            "world_size": self.world_size,
            "device_type": self.device_type,
            "tables": [
                {
                    "name": t.table, "module": t.module, "sharding_type": t.sharding_type,
                    "compute_kernel": t.compute_kernel, "ranks": t.ranks,
                    "shards": [{"sizes": s, "offsets": o} for s, o in zip(t.shard_sizes, t.shard_offsets)],
                }
                for t in self.tables
            ],
            "ranks": [dict(dataclasses.asdict(r), memory_bytes=r.memory_bytes) for r in self.ranks] if self.ranks else None,
            "imbalance": self.imbalance,
        }

    def write_json(self, path: "os.PathLike[str] | str") -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    def format_table(self) -> str:
        """The per-table plan, then the per-rank estimates, as fixed-width text (for the log)."""
        lines = [format_rows(self.tables, self.world_size)]
        if self.ranks:
            lines.append(f"{'rank':>4}  {'memory (MB)':>12}  {'HBM (MB)':>9}  {'DDR (MB)':>9}  {'cost':>10}")
            for r in self.ranks:
                lines.append(
                    f"{r.rank:>4}  {r.memory_bytes / 2**20:>12.2f}  {r.hbm_bytes / 2**20:>9.2f}  "
                    f"{r.ddr_bytes / 2**20:>9.2f}  {r.cost:>10.4g}"
                )
            imb = self.imbalance
            lines.append(f"imbalance (max/mean): memory {_fmt(imb['memory'])}, cost {_fmt(imb['cost'])}")
        else:
            lines.append("(no planner estimates: the plan was given, or this rank did not plan)")
        return "\n".join(lines)

    def write_png(self, path: "os.PathLike[str] | str") -> None:
        """A bar chart of memory and cost per rank (needs matplotlib; drawn off-screen)."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure

        fig = Figure(figsize=(max(4.0, 1.2 * self.world_size + 2), 3.5), dpi=100)
        ax = fig.add_subplot()
        ranks = list(range(self.world_size))
        if self.ranks:
            width = 0.38
            mem = [r.memory_bytes / 2**20 for r in self.ranks]
            ax.bar([x - width / 2 for x in ranks], mem, width, label="memory (MB)", color="tab:blue")
            twin = ax.twinx()
            twin.bar([x + width / 2 for x in ranks], [r.cost for r in self.ranks], width, label="cost (planner)",
                     color="tab:orange")
            ax.set_ylabel("memory (MB)")
            twin.set_ylabel("estimated cost")
            imb = self.imbalance
            ax.set_title(f"imbalance max/mean: memory {_fmt(imb['memory'])}, cost {_fmt(imb['cost'])}", fontsize=9)
            handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
            ax.legend(handles=handles, loc="lower center", fontsize=8, framealpha=0.9)
        else:
            shards = [sum(1 for t in self.tables for rk in t.ranks if rk == r) for r in ranks]
            ax.bar(ranks, shards, color="tab:blue")
            ax.set_ylabel("table shards")
            ax.set_title("no planner estimates: shards per rank", fontsize=9)
        ax.set_xticks(ranks)
        ax.set_xlabel("rank")
        fig.tight_layout()
        fig.savefig(path, format="png")


def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def write_plan_report(report: PlanReport, directory: "os.PathLike[str] | str") -> Optional[str]:
    """Write ``sharding_plan.json`` and ``sharding_plan.png`` into ``directory`` (the strategy passes the
    logger's ``log_dir``, e.g. ``lightning_logs/version_0``, or ``default_root_dir`` without a logger). Call it on
    rank 0 only. A failure (read-only directory, matplotlib missing) warns and never stops training.

    Returns:
        the directory written to, or ``None`` if writing failed.
    """
    from lightning.pytorch.utilities import rank_zero_warn

    out = os.fspath(directory)
    try:
        os.makedirs(out, exist_ok=True)
        report.write_json(os.path.join(out, "sharding_plan.json"))
        report.write_png(os.path.join(out, "sharding_plan.png"))
    except Exception as e:  # noqa: BLE001 - a report must never cost a training run
        rank_zero_warn(f"Could not write the sharding-plan report to {out}: {type(e).__name__}: {e}")
        return None
    return out
