"""Several topologies planned at once (``lightning-rec plan --hosts 1,2,4``): one :class:`SweepRow` each (memory per
rank, step time, samples/s, imbalance), as a table and a picture.

Example::

    rows = sweep(model, ShardingConfig.from_arguments(), sweep_clusters([1, 2, 4, 8], [8], preset="h100"))
    print(format_sweep(rows))
    write_sweep_png(rows, "sweep.png")
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_rec._planner.cluster import Cluster
from lightning_rec._planner.constants import GIB
from lightning_rec._planner.fit import DoesNotFit
from lightning_rec._planner.offline import plan_cluster, planning_optimizer
from lightning_rec._planner.report import PlanReport
from lightning_rec._strategy.sharding_config import ShardingConfig

__all__ = ["SweepRow", "format_sweep", "sweep", "write_sweep_png"]


@dataclass
class SweepRow:
    """One topology of a :func:`sweep`.

    Args:
        cluster: the topology.
        report: its plan, or ``None`` if the model does not fit.
        error: why it does not fit (``None`` if it does).
    """

    cluster: Cluster
    report: PlanReport | None
    error: str | None = None

    @property
    def samples_per_s(self) -> float | None:
        """Global samples per second the planner's step time allows (all ranks' batches per step)."""
        if self.report is None or not self.report.step_ms or not self.report.batch_size:
            return None
        return self.cluster.world_size * self.report.batch_size / (self.report.step_ms / 1000)

    def to_dict(self) -> dict[str, Any]:
        """One JSON row: the topology, memory of the fullest rank, step time, samples/s, imbalance."""
        r = self.report
        return {
            "hosts": self.cluster.hosts,
            "devices_per_host": self.cluster.devices_per_host,
            "world_size": self.cluster.world_size,
            "device": self.cluster.describe(),
            "fits": r is not None,
            "max_memory_bytes": r.max_memory_bytes if r else None,
            "step_ms": r.step_ms if r else None,
            "samples_per_s": self.samples_per_s,
            "imbalance": r.imbalance if r else None,
            "error": self.error,
        }


def sweep(module: nn.Module, sharding: ShardingConfig, clusters: Sequence[Cluster]) -> list[SweepRow]:
    """:func:`plan_cluster` for each topology; one that does not fit gets a row with its reason.

    Example::

        rows = sweep(model, ShardingConfig.from_arguments(), [Cluster(h, 8, preset="h100") for h in (1, 2, 4, 8)])
        print(format_sweep(rows))
    """
    rows = []
    tables = sharding.inventory(module)
    optimizer = planning_optimizer(module, sharding, clusters[0]._device_type, tables=tables) if clusters else None
    for cluster in clusters:
        try:
            report = plan_cluster(module, sharding, cluster, optimizer=optimizer, candidates=clusters, tables=tables)
            rows.append(SweepRow(cluster, report))
        except DoesNotFit as err:
            rows.append(SweepRow(cluster, None, str(err)))
    return rows


def format_sweep(rows: Sequence[SweepRow]) -> str:
    """The sweep as a fixed-width table: one row per topology.

    Example::

        hosts  devices/host  ranks  memory/rank (GiB)  step (ms)  samples/s  imbalance mem/cost
            1             8      8              61.20      3.512  1,166,393  1.01 / 1.03
    """
    header = ("hosts", "devices/host", "ranks", "memory/rank (GiB)", "step (ms)", "samples/s", "imbalance mem/cost")
    body = []
    for row in rows:
        d = row.to_dict()
        if not d["fits"]:
            body.append((d["hosts"], d["devices_per_host"], d["world_size"], "does not fit", "", "", ""))
            continue
        imb = d["imbalance"] or {}
        body.append(
            (
                d["hosts"],
                d["devices_per_host"],
                d["world_size"],
                f"{(d['max_memory_bytes'] or 0) / GIB:.2f}",
                f"{d['step_ms']:.4g}" if d["step_ms"] is not None else "n/a",
                f"{d['samples_per_s']:,.0f}" if d["samples_per_s"] else "n/a",
                " / ".join("n/a" if imb.get(k) is None else f"{imb[k]:.2f}" for k in ("memory", "cost")),
            )
        )
    widths = [max(len(str(r[i])) for r in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(str(v).rjust(w) for v, w in zip(r, widths)).rstrip() for r in [header, *body])


def write_sweep_png(rows: Sequence[SweepRow], path: os.PathLike[str] | str) -> None:
    """Memory per rank and samples/s for each topology that fits, off-screen (Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fits = [r for r in rows if r.report is not None]
    fig = Figure(figsize=(6.0, 3.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = list(range(len(fits)))  # evenly spaced: topologies usually double
    mem = [(report.max_memory_bytes or 0) / GIB for r in fits if (report := r.report) is not None]  # all of fits
    ax.plot(xs, mem, "o-", color="tab:blue", label="memory per rank (GiB)")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{r.cluster.hosts}x{r.cluster.devices_per_host}" for r in fits])
    ax.set_xlabel("hosts x devices per host")
    ax.set_ylabel("memory per rank (GiB)")
    twin = ax.twinx()
    twin.plot(xs, [r.samples_per_s or 0 for r in fits], "s--", color="tab:orange", label="samples/s (planner)")
    twin.set_ylabel("samples/s (planner's step time)")
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [str(ln.get_label()) for ln in lines], loc="upper center", fontsize=8)
    missing = [r.cluster.describe() for r in rows if r.report is None]
    title = "Planned topologies" + (f" (does not fit: {', '.join(missing)})" if missing else "")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
