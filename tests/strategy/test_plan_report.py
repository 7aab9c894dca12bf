"""The sharding-plan report: per-table rows, per-rank planner estimates, imbalance, JSON and PNG; written by
rank 0 only, next to the logs, at fit start."""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import json
import logging
import struct
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from lightning_rec import _compat
from lightning_rec._planner import estimates as plan_estimates
from lightning_rec._planner import report as plan_report
from lightning_rec._planner.estimates import imbalance
from lightning_rec._planner.planner import make_planner
from lightning_rec._planner.report import PlanReport, write_plan_report
from lightning_rec._planner.sharders import make_sharders
from lightning_rec._planner.table import plan_rows
from lightning_rec.config import TableConstraints
from tests.helpers.dist import run_ranks
from tests.helpers.models import RecModel
from tests.helpers.scenarios import MIXED_PLAN, make_loader, make_trainer

# matplotlib's tab:blue and tab:orange, the memory and cost bars
BLUE, ORANGE = (31, 119, 180), (255, 127, 14)


def _planned(world_size: int = 2):
    """A 3-table plan for ``world_size`` ranks, planned in this process (``plan()`` needs no process group)."""
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=1000 * (i + 1), feature_names=[f"f{i}"])
            for i in range(3)
        ],
        device=torch.device("meta"),
    )
    constraints = {
        "t0": TableConstraints(["column_wise"], min_partition=8),  # 2 column blocks of 8
        "t1": TableConstraints(["table_wise"]),
        "t2": TableConstraints(["data_parallel"]),
    }
    planner = make_planner(world_size=world_size, device_type="cpu", topology=None, constraints=constraints)
    plan = planner.plan(ebc, make_sharders({}))
    return plan, _compat.planner_sharding_options(planner)


def _png_colors(path: Path) -> set:
    import matplotlib.image

    rgb = (matplotlib.image.imread(str(path))[..., :3] * 255).round().astype(int).reshape(-1, 3)
    return {tuple(c) for c in rgb.tolist()}


def test_json_fields_per_rank_sums_and_imbalance() -> None:
    plan, options = _planned()
    assert options, "the planner's chosen options are reachable through _compat"
    doc = json.loads(json.dumps(PlanReport.from_plan(plan, 2, "cpu", options).to_dict()))
    assert doc["world_size"] == 2 and doc["device_type"] == "cpu" and doc["estimates_available"] is True

    tables = {t["name"]: t for t in doc["tables"]}
    assert set(tables) == {"t0", "t1", "t2"}
    assert {n: (t["sharding_type"], t["compute_kernel"]) for n, t in tables.items()} == {
        "t0": ("column_wise", "fused"),
        "t1": ("table_wise", "fused"),
        "t2": ("data_parallel", "dense"),
    }
    assert all(t["module"] == "" for t in tables.values())  # the EBC is the planned module itself
    t0 = tables["t0"]
    assert [s["sizes"] for s in t0["shards"]] == [[1000, 8], [1000, 8]]
    assert [s["offsets"] for s in t0["shards"]] == [[0, 0], [0, 8]]
    assert sorted(s["rank"] for s in t0["shards"]) == sorted(t0["ranks"])
    assert [(s["rank"], s["sizes"], s["offsets"]) for s in tables["t1"]["shards"]] == [
        (tables["t1"]["ranks"][0], [2000, 16], [0, 0])
    ]
    assert tables["t2"]["ranks"] == [0, 1] and tables["t2"]["shards"] == []  # replicated

    # Per rank: the sums over the planner's shards placed on that rank.
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    for r in doc["ranks"]:
        shards = [s for o in options for s in o.shards if s.rank == r["rank"]]
        assert len(shards) >= 2  # every rank holds a t2 replica plus a t0 or t1 shard
        assert r["ddr_bytes"] == sum(s.storage.ddr for s in shards) > 0
        assert r["hbm_bytes"] == 0  # CPU training keeps tables in host memory
        assert r["memory_bytes"] == r["ddr_bytes"] + r["hbm_bytes"]
        assert r["cost"] == pytest.approx(sum(s.perf.total for s in shards))
    # Over all ranks: every shard counted exactly once.
    all_shards = [s for o in options for s in o.shards]
    assert sum(r["memory_bytes"] for r in doc["ranks"]) == sum(s.storage.ddr + s.storage.hbm for s in all_shards)

    mem, cost = [r["memory_bytes"] for r in doc["ranks"]], [r["cost"] for r in doc["ranks"]]
    assert doc["imbalance"]["memory"] == pytest.approx(max(mem) / (sum(mem) / 2))
    assert doc["imbalance"]["cost"] == pytest.approx(max(cost) / (sum(cost) / 2))
    assert set(doc["imbalance"]) == {"memory", "cost"} and doc["imbalance_definition"] == "max / mean over ranks"


def test_imbalance_definition_and_docstring_examples() -> None:
    assert imbalance([1.0, 1.0, 1.0]) == 1.0
    assert imbalance([4.0, 0.0]) == 2.0  # one of two ranks carries everything
    assert imbalance([3, 1, 2]) == pytest.approx(1.5)
    assert imbalance([0, 0]) is None and imbalance([1.0, None]) is None and imbalance([]) is None
    result = doctest.testmod(plan_estimates, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0


def test_rows_come_from_sharding_plan_rows() -> None:
    plan, options = _planned()
    report = PlanReport.from_plan(plan, 2, "cpu", options)
    assert report.tables == plan_rows(plan)
    text = report.format_table()
    for needle in ("t0", "t1", "t2", "column_wise", "data_parallel", "cost (ms)", "imbalance (max/mean over ranks)"):
        assert needle in text, needle
    assert len(text.splitlines()) == 1 + 3 + 1 + 2 + 1  # header, 3 tables, rank header, 2 ranks, imbalance


def test_world_size_one_needs_no_process_group() -> None:
    plan, options = _planned(world_size=1)
    doc = PlanReport.from_plan(plan, 1, "cpu", options).to_dict()
    assert len(doc["ranks"]) == 1 and doc["imbalance"]["memory"] == 1.0 and doc["imbalance"]["cost"] == 1.0


def test_without_estimates_numbers_are_null(tmp_path: Path) -> None:
    plan, _ = _planned()
    report = PlanReport.from_plan(plan, 2, "cpu", None)
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["estimates_available"] is False
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert all(v is None for r in doc["ranks"] for k, v in r.items() if k != "rank")
    assert doc["step_ms"] is None and doc["max_memory_bytes"] is None
    assert doc["imbalance"]["memory"] is None and doc["imbalance"]["cost"] is None
    assert len(doc["tables"]) == 3  # the plan itself is still reported
    assert "planner estimates unavailable" in report.format_table()
    report.write_png(tmp_path / "p.png")
    colors = _png_colors(tmp_path / "p.png")
    assert BLUE in colors and ORANGE not in colors  # shards per rank only, no cost bars


def test_png_is_a_bar_chart_of_memory_and_cost(tmp_path: Path) -> None:
    plan, options = _planned()
    path = tmp_path / "plan.png"
    PlanReport.from_plan(plan, 2, "cpu", options).write_png(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (500, 380) and len(data) > 5000
    colors = _png_colors(path)
    assert BLUE in colors and ORANGE in colors  # memory and cost bars both drawn


def test_write_creates_the_directory_and_survives_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan, options = _planned()
    report = PlanReport.from_plan(plan, 2, "cpu", options)
    out = Path(write_plan_report(report, tmp_path / "logs" / "version_0"))
    assert out == tmp_path / "logs" / "version_0"
    assert json.loads((out / "sharding_plan.json").read_text()) == json.loads(json.dumps(report.to_dict()))
    assert (out / "sharding_plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.warns(UserWarning, match=r"could not write the sharding-plan report .*HINT"):
        assert write_plan_report(report, blocked / "x") is None

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    monkeypatch.delitem(sys.modules, "matplotlib.figure", raising=False)
    monkeypatch.delitem(sys.modules, "matplotlib.backends.backend_agg", raising=False)
    monkeypatch.delitem(sys.modules, "matplotlib.backends", raising=False)
    with pytest.warns(UserWarning, match=r"(ImportError|ModuleNotFoundError): .*matplotlib"):
        assert write_plan_report(report, tmp_path / "no_mpl") is None
    assert (tmp_path / "no_mpl" / "sharding_plan.json").exists()  # the JSON does not need matplotlib


@pytest.mark.dist
def test_two_process_fit_writes_once_on_rank_zero_into_the_log_dir(tmp_path: Path) -> None:
    res = run_ranks(fit_report, 2, tmp_path)
    log_dir = Path(res[0]["log_dir"])
    assert res[1]["log_dir"] == res[0]["log_dir"] and log_dir == tmp_path / "logs" / "version_0"
    assert res[0]["writes"] == [str(log_dir)] and res[1]["writes"] == []  # rank 0 alone writes
    assert sorted(tmp_path.rglob("sharding_plan.*")) == [log_dir / "sharding_plan.json", log_dir / "sharding_plan.png"]
    assert all(r["global_step"] == 2 for r in res)

    doc = json.loads((log_dir / "sharding_plan.json").read_text())
    assert doc["world_size"] == 2 and doc["device_type"] == "cpu"
    assert doc["estimates_available"] is True, "written from rank 0, the rank that planned"
    assert res[0]["plan"] == res[1]["plan"]
    plan = {r["table"]: r for r in res[0]["plan"]}
    assert {t["name"]: t["sharding_type"] for t in doc["tables"]} == {
        name: c["sharding_types"][0] for name, c in MIXED_PLAN.items()
    }
    for t in doc["tables"]:
        row = plan[t["name"]]
        assert (t["module"], t["sharding_type"], t["compute_kernel"], t["ranks"]) == (
            row["module"],
            row["sharding_type"],
            row["compute_kernel"],
            row["ranks"],
        )
        assert [s["sizes"] for s in t["shards"]] == row["shard_sizes"]
        assert [s["offsets"] for s in t["shards"]] == row["shard_offsets"]
        assert [s["rank"] for s in t["shards"]] == row["shard_ranks"]
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert all(r["memory_bytes"] > 0 and r["cost"] > 0 for r in doc["ranks"])
    mem = [r["memory_bytes"] for r in doc["ranks"]]
    assert doc["imbalance"]["memory"] == pytest.approx(max(mem) / (sum(mem) / 2))
    assert (log_dir / "sharding_plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = (tmp_path / "tests.strategy.test_plan_report:fit_report.rank0.log").read_text()
    assert "imbalance (max/mean over ranks)" in log, "rank 0 logs the table with the estimates"


@pytest.mark.dist
def test_report_without_logger_with_fixed_plan_disabled_and_unwritable(tmp_path: Path) -> None:
    res = run_ranks(report_variants, 1, tmp_path)[0]
    # logger=False: the plan is logged, no file is written (not in default_root_dir, not in the working directory).
    assert res["no_logger"]["writes"] == [] and res["no_logger"]["global_step"] == 2
    assert not (tmp_path / "no_logger").exists()
    written = sorted(p.relative_to(tmp_path).parts[0] for p in tmp_path.rglob("sharding_plan.*"))
    assert written == ["fixed_plan", "fixed_plan"], written
    assert "\n".join(res["log"]).count("sharding plan over 1 rank(s)") == 4, (
        "the table is logged with or without a logger"
    )

    fixed = json.loads((tmp_path / "fixed_plan" / "sharding_plan.json").read_text())
    assert fixed["estimates_available"] is False and fixed["ranks"][0]["memory_bytes"] is None
    assert len(fixed["tables"]) == 3

    assert res["disabled"]["writes"] == [] and not list((tmp_path / "disabled").glob("sharding_plan.*"))

    assert res["unwritable"]["global_step"] == 2, "a report failure must not stop training"
    assert len(res["unwritable"]["warnings"]) == 1 and "HINT" in res["unwritable"]["warnings"][0]


# ------------------------------------------------------------------------------------------------------------
# What each rank runs (run_ranks imports them from this module).
# ------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _recorded_writes() -> Iterator[list[str]]:
    """Record every directory the report is written to (every write goes through
    ``plan_report.write_plan_report``), so a test can tell which rank wrote; put the function back afterwards (one
    rank runs in the test's own process)."""
    calls: list[str] = []
    original = plan_report.write_plan_report

    def recording(report: PlanReport, directory: Any) -> Any:
        calls.append(str(directory))
        return original(report, directory)

    plan_report.write_plan_report = recording
    try:
        yield calls
    finally:
        plan_report.write_plan_report = original


def fit_report(rank: int, world_size: int, out_dir: Path, steps: int = 2) -> dict[str, Any]:
    """Fit with a CSV logger (MIXED_PLAN constraints); report where this rank wrote and the plan it sharded with."""
    with _recorded_writes() as calls:
        L.seed_everything(0)
        tr = make_trainer(
            world_size, steps, logger=CSVLogger(out_dir, name="logs"), default_root_dir=str(out_dir / "root")
        )
        tr.fit(RecModel(), make_loader(rank, steps, 16, {}))
    return {
        "writes": calls,
        "log_dir": tr.log_dir,
        "plan": [dataclasses.asdict(r) for r in plan_rows(tr.strategy.sharding_plan)],
        "global_step": tr.global_step,
    }


class _SilentLogger(Logger):
    """A logger that writes nothing itself, with a directory that cannot be created (only the report tries)."""

    def __init__(self, save_dir: Path) -> None:
        super().__init__()
        self._save_dir = str(save_dir)

    @property
    def name(self) -> str:
        return "silent"

    @property
    def version(self) -> int:
        return 0

    @property
    def save_dir(self) -> str:
        return self._save_dir

    def log_metrics(self, metrics: dict[str, float], step: Any = None) -> None:
        pass

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class _Messages(logging.Handler):
    """Every message Lightning's loggers emit (``rank_zero_info`` included), as it formats them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def report_variants(rank: int, world_size: int, out_dir: Path, steps: int = 2) -> dict[str, Any]:
    """Three fits: no logger (nothing written, anywhere), a fixed ``plan=`` (no estimates), ``report_plan=False``;
    then one whose report directory cannot be created (warns, trains). All but the first log to a CSV logger in
    ``root``. Also reports what Lightning's loggers said (``log``)."""
    results: dict[str, Any] = {}
    messages = _Messages()
    lightning_log = logging.getLogger("lightning.pytorch")
    lightning_log.addHandler(messages)
    with _recorded_writes() as calls:

        def fit(tag: str, strategy: dict[str, Any], root: Path, logger: Any = True) -> L.Trainer:
            L.seed_everything(0)
            tr = make_trainer(
                world_size,
                steps,
                strategy=strategy,
                default_root_dir=str(root),
                logger=CSVLogger(root, name="", version="") if logger is True else logger,
            )
            tr.fit(RecModel(), make_loader(rank, steps, 16, {}))
            results[tag] = {"global_step": tr.global_step, "writes": list(calls)}
            calls.clear()
            return tr

        try:
            planned = fit("no_logger", {}, out_dir / "no_logger", logger=False)
            fit("fixed_plan", {"plan": planned.strategy.sharding_plan}, out_dir / "fixed_plan")
            fit("disabled", {"report_plan": False}, out_dir / "disabled")
            blocked = out_dir / "blocked"
            blocked.write_text("a file where the report directory should go")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fit("unwritable", {}, blocked / "root", logger=_SilentLogger(blocked / "root"))
        finally:
            lightning_log.removeHandler(messages)
    results["unwritable"]["warnings"] = [str(w.message) for w in caught if "sharding-plan report" in str(w.message)]
    results["log"] = messages.messages
    return results
