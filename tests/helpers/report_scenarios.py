"""Per-rank scenarios for the sharding-plan report (run through tests.helpers.dist.run_ranks as
``tests.helpers.report_scenarios:<function>``)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger, Logger

from lightning_rec._strategy import plan_report
from lightning_rec._strategy.plan_report import plan_rows
from tests.helpers.models import RecModel
from tests.helpers.scenarios import make_loader, make_trainer


def _record_writes() -> list[str]:
    """Record, in this process, every directory the report is written to (every write goes through
    ``plan_report.write_plan_report``), so a test can tell which rank wrote."""
    calls: list[str] = []
    original = plan_report.write_plan_report

    def recording(report: plan_report.PlanReport, directory: Any) -> Any:
        calls.append(str(directory))
        return original(report, directory)

    plan_report.write_plan_report = recording  # this worker process only
    return calls


def fit_report(rank: int, world_size: int, out_dir: Path, steps: int = 2) -> dict[str, Any]:
    """Fit with a CSV logger (MIXED_PLAN constraints); report where this rank wrote and the plan it sharded with."""
    calls = _record_writes()
    L.seed_everything(0)
    tr = make_trainer(world_size, steps, logger=CSVLogger(out_dir, name="logs"), default_root_dir=str(out_dir / "root"))
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


def report_variants(rank: int, world_size: int, out_dir: Path, steps: int = 2) -> dict[str, Any]:
    """Three fits: no logger (nothing written, anywhere), a fixed ``plan=`` (no estimates), ``report_plan=False``;
    then one whose report directory cannot be created (warns, trains). All but the first log to a CSV logger in
    ``root``."""
    calls = _record_writes()
    results: dict[str, Any] = {}

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

    planned = fit("no_logger", {}, out_dir / "no_logger", logger=False)
    fit("fixed_plan", {"plan": planned.strategy.sharding_plan}, out_dir / "fixed_plan")
    fit("disabled", {"report_plan": False}, out_dir / "disabled")
    blocked = out_dir / "blocked"
    blocked.write_text("a file where the report directory should go")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit("unwritable", {}, blocked / "root", logger=_SilentLogger(blocked / "root"))
    results["unwritable"]["warnings"] = [str(w.message) for w in caught if "sharding-plan report" in str(w.message)]
    return results
