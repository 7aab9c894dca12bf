"""lightning_rec._planner.chart: the report's picture, with and without the planner's estimates."""

from __future__ import annotations

from pathlib import Path

from lightning_rec._planner.chart import draw_plan_chart
from lightning_rec._planner.estimates import RankEstimate
from lightning_rec._planner.report import PlanReport
from lightning_rec._planner.table import PlanRow

PNG = b"\x89PNG\r\n\x1a\n"


def test_a_picture_is_drawn_with_estimates_and_without(tmp_path: Path) -> None:
    rows = [PlanRow("ebc", "user", "table_wise", "fused", [1], [[10, 4]], [[0, 0]], [1])]
    ranks = [RankEstimate(0, 0, 10, 0.1), RankEstimate(1, 0, 30, 0.3)]
    draw_plan_chart(PlanReport(2, "cpu", rows, ranks, estimates_available=True), tmp_path / "a.png")
    draw_plan_chart(PlanReport(2, "cpu", rows, [RankEstimate(0), RankEstimate(1)]), tmp_path / "b.png")
    assert (tmp_path / "a.png").read_bytes()[:8] == PNG and (tmp_path / "b.png").read_bytes()[:8] == PNG
