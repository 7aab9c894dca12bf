"""The tests' multi-process harness: :mod:`lightning_rec.testing.launch` with the tests' scenarios.

Scenarios are functions defined at the top level of a ``tests.helpers.*_scenarios`` module, passed as functions
(``run_ranks(checkpoint_scenarios.reshard, 2, tmp_path)``); the ranks get the repository on their path, so they
import them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_rec.testing.launch import LAUNCHERS, Launch, Process
from lightning_rec.testing.launch import launch as _launch
from lightning_rec.testing.launch import run_ranks as _run_ranks
from lightning_rec.testing.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = "tests.helpers.scenarios"

__all__ = ["LAUNCHERS", "REPO", "Launch", "Process", "free_port", "launch", "run_ranks"]


def launch(scenario: str | Callable[..., Any], world_size: int, out_dir: Path, **kwargs: Any) -> Launch:
    """:func:`lightning_rec.testing.launch.launch` with the tests' scenarios and the repository on the path."""
    return _launch(scenario, world_size, out_dir, scenarios=SCENARIOS, pythonpath=[str(REPO)], **kwargs)


def run_ranks(
    scenario: str | Callable[..., Any], world_size: int, out_dir: Path, timeout: float = 300, **kwargs: Any
) -> list[dict[str, Any]]:
    """:func:`lightning_rec.testing.launch.run_ranks` with the tests' scenarios and the repository on the path."""
    return _run_ranks(scenario, world_size, out_dir, timeout, scenarios=SCENARIOS, pythonpath=[str(REPO)], **kwargs)
