"""The tests' multi-process harness: :mod:`lightning_rec.testing.launch` with the tests' scenarios.

Scenarios are functions defined at the top level of the test module that uses them (or, when several modules share
one, of a ``tests.helpers.*_scenarios`` module), passed as functions (``run_ranks(fit, 2, tmp_path)``); the ranks
get the repository on their path, so they import them.

One rank runs in this process (:func:`run_ranks`), so a breakpoint stops there and its warnings reach the person
running the test; a scenario whose numbers need a fresh process asks for one (``subprocess=True``, saying why).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_rec.testing.launch import LAUNCHERS, Launch, Process, scenario_name
from lightning_rec.testing.launch import launch as _launch
from lightning_rec.testing.launch import run_ranks as _run_ranks
from lightning_rec.testing.ports import free_port, rank_env, shell_env

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = "tests.helpers.scenarios"

__all__ = ["LAUNCHERS", "REPO", "Launch", "Process", "free_port", "launch", "run_ranks"]


def launch(scenario: str | Callable[..., Any], world_size: int, out_dir: Path, **kwargs: Any) -> Launch:
    """:func:`lightning_rec.testing.launch.launch` with the tests' scenarios and the repository on the path."""
    return _launch(scenario, world_size, out_dir, scenarios=SCENARIOS, pythonpath=[str(REPO)], **kwargs)


def run_ranks(
    scenario: str | Callable[..., Any],
    world_size: int,
    out_dir: Path,
    timeout: float = 300,
    *,
    subprocess: bool = False,
    launcher: str = "env",
    nodes: int = 1,
    **config: Any,
) -> list[dict[str, Any]]:
    """:func:`lightning_rec.testing.launch.run_ranks` with the tests' scenarios and the repository on the path.

    One rank started the default way (``launcher="env"``) runs in this process (see :func:`_run_here`): same
    arguments, environment, working directory and JSON round trip as a spawned rank, but a breakpoint stops in it,
    its warnings and logs reach pytest, and its exception is raised here as is (``timeout`` is pytest-timeout's
    then). ``subprocess=True`` spawns it anyway: for a scenario whose numbers depend on a fresh process.
    """
    if world_size == 1 and not subprocess and launcher == "env" and nodes == 1:
        return [_run_here(scenario, Path(out_dir), config)]
    return _run_ranks(
        scenario,
        world_size,
        out_dir,
        timeout,
        launcher=launcher,
        nodes=nodes,
        scenarios=SCENARIOS,
        pythonpath=[str(REPO)],
        **config,
    )


def _run_here(scenario: str | Callable[..., Any], out_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Run ``scenario`` as rank 0 of 1 in this process, the way :mod:`lightning_rec.testing.worker` runs it in a
    spawned one, and put this process back as it was.

    The rank's environment is what :func:`lightning_rec.testing.launch.launch` gives a spawned rank (the rendezvous
    variables of rank 0 of 1 on a free port, ``OMP_NUM_THREADS=1`` and one intra-op thread, no SLURM or torchelastic
    variables; warnings left on, on purpose); it works in ``out_dir``. Afterwards the environment, working
    directory, thread count and random generators are restored and any process group it left is destroyed, so the
    next test starts clean. The result goes through JSON (and into ``<scenario>.rank0.json``) as a spawned rank's
    does.
    """
    name = scenario_name(scenario)  # refuses what a spawned rank could not import, here too
    if isinstance(scenario, str):
        module, _, func = scenario.rpartition(":")
        scenario = getattr(importlib.import_module(module or SCENARIOS), func)
    out_dir.mkdir(parents=True, exist_ok=True)
    saved_env, cwd, threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    env = {k: v for k, v in shell_env().items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    try:
        os.environ.clear()
        os.environ.update({**env, "OMP_NUM_THREADS": "1", **rank_env(0, 1, free_port())})
        torch.set_num_threads(1)
        os.chdir(out_dir)
        result = json.dumps(scenario(rank=0, world_size=1, out_dir=out_dir, **config))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.chdir(cwd)
        torch.set_num_threads(threads)
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        os.environ.clear()
        os.environ.update(saved_env)
    (out_dir / f"{name}.rank0.json").write_text(result)
    return json.loads(result)


@contextlib.contextmanager
def in_this_process(work: Path) -> Iterator[None]:
    """Run a fit in the test's own process, in ``work``, and give back what it changes: the working directory, the
    environment (Lightning leaves ``MASTER_PORT`` in it) and the process group (holding that port).

    For module-scoped fixtures, which run before conftest's per-test isolation does the same.

    Example::

        with in_this_process(work):
            trainer.fit(model, loader)
            trainer.save_checkpoint(work / "ckpt")
    """
    saved, cwd = dict(os.environ), os.getcwd()
    try:
        os.chdir(work)
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)
