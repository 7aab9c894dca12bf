"""The sharding-plan report: per-table rows, per-rank planner estimates, imbalance, JSON and PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from lightning_rec import _compat
from lightning_rec.plan_report import PlanReport, write_plan_report
from lightning_rec.sharding import TableConstraints, make_planner, make_sharders


def _planned(world_size: int = 2):
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=1000 * (i + 1), feature_names=[f"f{i}"])
                for i in range(3)],
        device=torch.device("meta"),
    )
    constraints = {"t0": TableConstraints(["column_wise"]), "t1": TableConstraints(["table_wise"]),
                   "t2": TableConstraints(["data_parallel"])}
    planner = make_planner(world_size=world_size, device_type="cpu", topology=None, constraints=constraints)
    plan = planner.plan(ebc, make_sharders({}))
    return plan, _compat.planner_sharding_options(planner)


def test_report_rows_estimates_and_imbalance() -> None:
    plan, options = _planned()
    report = PlanReport.from_plan(plan, 2, "cpu", options)
    doc = report.to_dict()
    kinds = {t["name"]: (t["sharding_type"], t["compute_kernel"]) for t in doc["tables"]}
    assert kinds == {"t0": ("column_wise", "fused"), "t1": ("table_wise", "fused"), "t2": ("data_parallel", "dense")}
    t0 = next(t for t in doc["tables"] if t["name"] == "t0")
    assert sum(s["sizes"][1] for s in t0["shards"]) == 16 and all(s["sizes"][0] == 1000 for s in t0["shards"])
    # Per-rank totals are the sums over the planner's shards placed on that rank.
    for r in doc["ranks"]:
        shards = [s for o in options for s in o.shards if s.rank == r["rank"]]
        assert r["ddr_bytes"] == sum(s.storage.ddr for s in shards) and r["hbm_bytes"] == 0  # CPU: host memory
        assert r["cost"] == pytest.approx(sum(s.perf.total for s in shards))
    mem = [r["memory_bytes"] for r in doc["ranks"]]
    assert doc["imbalance"]["memory"] == pytest.approx(max(mem) / (sum(mem) / 2))
    assert "imbalance (max/mean)" in report.format_table() and "t1" in report.format_table()


def test_without_estimates_the_report_says_so(tmp_path: Path) -> None:
    plan, _ = _planned()
    report = PlanReport.from_plan(plan, 2, "cpu", None)
    assert report.to_dict()["ranks"] is None and report.imbalance == {"memory": None, "cost": None}
    assert "no planner estimates" in report.format_table()
    report.write_png(tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_write_next_to_logs_and_survive_failures(tmp_path: Path) -> None:
    plan, options = _planned()
    report = PlanReport.from_plan(plan, 2, "cpu", options)
    out = Path(write_plan_report(report, tmp_path / "logs" / "version_0"))
    assert out == tmp_path / "logs" / "version_0"
    assert json.loads((out / "sharding_plan.json").read_text()) == json.loads(json.dumps(report.to_dict()))
    png = (out / "sharding_plan.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.warns(UserWarning, match="sharding-plan report"):
        assert write_plan_report(report, blocked / "x") is None
