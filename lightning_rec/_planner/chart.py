"""The sharding-plan report's picture: memory and cost per rank as bars (``sharding_plan.png``).

Drawn with matplotlib, imported only when a picture is drawn, on its off-screen Agg canvas (no display is touched).
The report itself: :mod:`lightning_rec._planner.report`.
"""

from __future__ import annotations

import os
from typing import Protocol, cast

from lightning_rec._planner.constants import MIB
from lightning_rec._planner.estimates import RankEstimate
from lightning_rec._planner.table import PlanRow

__all__ = ["draw_plan_chart"]


class Charted(Protocol):
    """What the picture reads of a :class:`~lightning_rec._planner.report.PlanReport` (which draws itself with
    :func:`draw_plan_chart`, so this module does not import it)."""

    world_size: int
    device_type: str
    tables: list[PlanRow]
    ranks: list[RankEstimate]
    estimates_available: bool

    def imbalance_text(self) -> str: ...  # noqa: D102


def draw_plan_chart(report: Charted, path: os.PathLike[str] | str) -> None:
    """Draw memory and cost per rank of ``report`` as grouped bars on twin axes, titled with the imbalance, into
    the PNG file ``path``.

    Needs matplotlib (imported here, drawn off-screen with the Agg canvas, so no display is touched).
    Without estimates it draws the number of table shards per rank instead.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(max(5.0, 0.9 * report.world_size + 3.0), 3.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = list(range(report.world_size))
    if report.estimates_available:
        width = 0.38
        mem_mb = [(r.memory_bytes or 0) / MIB for r in report.ranks]
        cost = [r.cost or 0.0 for r in report.ranks]
        bars = ax.bar([x - width / 2 for x in xs], mem_mb, width, label="memory (MB)", color="tab:blue")
        twin = ax.twinx()
        bars2 = twin.bar([x + width / 2 for x in xs], cost, width, label="cost (ms/step)", color="tab:orange")
        # Headroom above the bars for the legend.
        ax.set_ylim(0, 1.3 * max(mem_mb + [1e-9]))
        twin.set_ylim(0, 1.3 * max(cost + [1e-9]))
        ax.set_ylabel("memory (MB)")
        twin.set_ylabel("planner cost (ms/step)")
        ax.legend(handles=[bars, bars2], loc="upper center", ncol=2, fontsize=8, framealpha=0.9)
        subtitle = f"imbalance (max/mean over ranks): {report.imbalance_text()}"
    else:
        shards = [sum(r in t.shard_ranks or (not t.shard_ranks and r in t.ranks) for t in report.tables) for r in xs]
        ax.bar(xs, shards, color="tab:blue")
        ax.set_ylabel("tables with a shard here")
        # a bar chart's y axis keeps its default AutoLocator, a MaxNLocator (matplotlib types it as a Locator)
        cast(MaxNLocator, ax.yaxis.get_major_locator()).set_params(integer=True)
        subtitle = "planner estimates unavailable: tables per rank"
    ax.set_title(f"Sharding plan: {report.world_size} rank(s), {report.device_type}\n{subtitle}", fontsize=9)
    ax.set_xticks(xs)
    ax.set_xlabel("rank")
    fig.tight_layout()
    fig.savefig(path, format="png")
