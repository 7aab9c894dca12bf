"""lightning_rec._planner.sweep: several topologies, one row each."""

from __future__ import annotations

from pathlib import Path

from lightning_rec._planner.cluster import Cluster
from lightning_rec._planner.estimates import RankEstimate
from lightning_rec._planner.report import PlanReport
from lightning_rec._planner.sweep import SweepRow, format_sweep, sweep, write_sweep_png
from lightning_rec._strategy.sharding_config import ShardingConfig
from tests.planner.tables import Tiny


def test_a_row_is_a_topologys_memory_step_and_samples_per_second() -> None:
    report = PlanReport(
        2, "cpu", [], [RankEstimate(r, 0, 2**30, 1.0, 1.0, 0.0, 1.0) for r in range(2)], True, batch_size=100
    )
    row = SweepRow(Cluster(1, 2, "cpu"), report).to_dict()
    assert (row["world_size"], row["fits"], row["max_memory_bytes"], row["step_ms"]) == (2, True, 2**30, 2.0)
    assert row["samples_per_s"] == 2 * 100 / 0.002
    missing = SweepRow(Cluster(2, 2, "cpu"), None, "too big")
    text = format_sweep([SweepRow(Cluster(1, 2, "cpu"), report), missing])
    assert "does not fit" in text.splitlines()[2] and "1.00" in text.splitlines()[1]


def test_a_sweep_plans_every_cluster_and_draws_them(tmp_path: Path) -> None:
    rows = sweep(Tiny(), ShardingConfig.from_arguments(), [Cluster(1, 1, "cpu"), Cluster(1, 2, "cpu")])
    assert [r.cluster.world_size for r in rows] == [1, 2] and all(r.report is not None for r in rows)
    write_sweep_png(rows, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
