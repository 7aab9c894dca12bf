"""lightning_rec._planner.report: the plan and its estimates as JSON, read back as they were written."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_rec._planner.planner import make_plan
from lightning_rec._planner.report import PlanReport
from tests.planner.tables import Tiny, request


def test_a_planned_report_round_trips_through_json(tmp_path: Path) -> None:
    model = Tiny()
    _, report = make_plan(model, request(model, world_size=4, local_world_size=2))
    report.write_json(tmp_path / "plan.json")
    again = PlanReport.read_json(tmp_path / "plan.json")
    assert again.to_dict() == report.to_dict() and again.num_hosts == 2
    doc = report.to_dict()
    assert doc["step_ms"] == max(r["step_ms"] for r in doc["ranks"]) and set(doc["imbalance"]) == {"memory", "cost"}
    assert "imbalance (max/mean over ranks)" in report.format_table()


def test_what_is_not_a_report_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text('{"world_size": 2}')
    with pytest.raises(ValueError, match=r"x.json.*not a sharding plan.*device_type, tables"):
        PlanReport.read_json(tmp_path / "x.json")
    bare = PlanReport.from_dict({"world_size": 1, "device_type": "cpu", "tables": []})
    assert "planner estimates unavailable" in bare.format_table() and bare.step_ms is None
