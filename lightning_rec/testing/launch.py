"""The multi-process harness of the tests and benchmarks: really start N ranks (gloo on CPU), each running a
scenario, and collect what each rank reports, how it ended and when.

Every rank is a fresh ``python -m lightning_rec.testing.worker`` process, started the way a launcher would start it:

* ``launcher="env"``: one process per rank with the variables torchrun-like launchers set (RANK, LOCAL_RANK,
  WORLD_SIZE, MASTER_ADDR/PORT), so Lightning sees processes created externally;
* ``launcher="slurm"``: one process per rank with only the variables ``srun`` sets (SLURM_PROCID, SLURM_NTASKS,
  SLURM_NODEID, ...), so Lightning's SLURM detection takes over; ``SLURM_JOB_ID`` is the same for every launch into
  one ``out_dir``, as a requeued job keeps its id (what a checkpoint's run is compared by);
* ``launcher="torchrun"``: one real ``torchrun`` agent per node (``--nnodes=N`` with a c10d rendezvous on
  127.0.0.1), each starting its share of the ranks: several "hosts" on one machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_rec.testing.ports import free_port, shell_env

__all__ = ["LAUNCHERS", "Launch", "Process", "launch", "run_ranks", "scenario_name"]

LAUNCHERS = ("env", "slurm", "torchrun")


@dataclass
class Process:
    """One launched process (a rank, or a torchrun agent) and how it ended.

    Args:
        name: ``"rank0"``, ... or ``"node0"``, ... for torchrun agents.
        returncode: its exit code; ``None`` if it was still running when the harness stopped waiting (then killed).
        ended: ``time.time()`` when it exited (``None`` if it did not).
        log: its combined stdout/stderr.
    """

    name: str
    returncode: int | None
    ended: float | None
    log: str


@dataclass
class Launch:
    """What :func:`launch` saw: each process, and each rank's result (``None`` for a rank that wrote none)."""

    processes: list[Process]
    results: list[dict[str, Any] | None]

    def log(self, name: str) -> str:
        """The combined stdout/stderr of the process ``name`` (``"rank0"``, ``"node1"``, ...)."""
        return next(p.log for p in self.processes if p.name == name)


def _worker_command(scenario: str, out_dir: Path, config: dict[str, Any], scenarios: str | None) -> list[str]:
    return [
        "-m",
        "lightning_rec.testing.worker",
        scenario,
        json.dumps(config),
        str(out_dir),
        *filter(None, [scenarios]),
    ]


def _commands(launcher: str, worker: list[str], world_size: int, nodes: int, job_id: int) -> dict[str, tuple]:
    """``{process name: (argv, extra env)}`` for each process to start; ``worker``: what a rank runs, after
    ``python``."""
    port = free_port()
    per_node = world_size // nodes
    if launcher == "torchrun":
        rdzv = [
            f"--nnodes={nodes}",
            f"--nproc-per-node={per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=lightning_rec_{port}",
            "--local-addr=127.0.0.1",
            "--max-restarts=0",
            "--monitor-interval=0.5",
        ]
        return {
            f"node{n}": (
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    *rdzv,
                    *(["--rdzv-conf=is_host=false"] if n else []),
                    *worker,
                ],
                {},
            )
            for n in range(nodes)
        }
    commands = {}
    for rank in range(world_size):
        node, local = divmod(rank, per_node)
        if launcher == "env":
            env = {
                "RANK": rank,
                "LOCAL_RANK": local,
                "WORLD_SIZE": world_size,
                "LOCAL_WORLD_SIZE": per_node,
                "NODE_RANK": node,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }
        elif launcher == "slurm":
            env = {
                "SLURM_PROCID": rank,
                "SLURM_LOCALID": local,
                "SLURM_NODEID": node,
                "SLURM_NTASKS": world_size,
                "SLURM_NTASKS_PER_NODE": per_node,
                "SLURM_NNODES": nodes,
                "SLURM_JOB_ID": job_id,
                "SLURM_JOB_NAME": "lightning_rec_test",
                "SLURM_NODELIST": "127.0.0.1",
                "MASTER_PORT": port,
            }
        else:
            raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
        commands[f"rank{rank}"] = ([sys.executable, *worker], {k: str(v) for k, v in env.items()})
    return commands


def scenario_name(scenario: str | Callable[..., Any]) -> str:
    """``"module:function"`` of a scenario given as a function (importable on the ranks), or the string as is.

    Example::

        >>> scenario_name(scenario_name)
        'lightning_rec.testing.launch:scenario_name'
    """
    if isinstance(scenario, str):
        return scenario
    if "<" in scenario.__qualname__:
        raise ValueError(f"scenario {scenario.__qualname__!r} is not importable: define it at a module's top level.")
    return f"{scenario.__module__}:{scenario.__qualname__}"


def launch(
    scenario: str | Callable[..., Any],
    world_size: int,
    out_dir: Path,
    *,
    launcher: str = "env",
    nodes: int = 1,
    timeout: float = 300,
    wait_for: Sequence[str] | None = None,
    command: list[str] | None = None,
    scenarios: str | None = None,
    pythonpath: Sequence[str] = (),
    fresh: bool = False,
    **config: Any,
) -> Launch:
    """Start ``scenario`` (a top-level function, ``"module:function"``, or a function name in the module
    ``scenarios``) on ``world_size`` ranks
    spread over ``nodes`` hosts, and wait for the processes to end.

    Each rank calls ``function(rank=..., world_size=..., out_dir=..., **config)`` and its JSON-able return value
    becomes that rank's result. The processes work in ``out_dir``, where their logs
    (``<scenario>.<process>.log``) and results (``<scenario>.rank<R>.json``) land.

    Args:
        scenario: a function defined at a module's top level, ``"package.module:function"``, or a function name in
            ``scenarios``.
        world_size: how many ranks.
        out_dir: the processes' working directory (created if need be).
        nodes: how many "hosts" the ranks are spread over (``launcher="torchrun"`` starts one agent per host).
        command: run this instead of the scenario (what follows ``python`` on each rank, e.g. a script and its
            arguments); ``scenario`` then only names the logs, and no rank writes a result.
        launcher: how the ranks are started (see the module docstring).
        timeout: seconds to wait in all; processes still running then are killed (``returncode`` ``None``).
        wait_for: names of the processes to wait for (default: all); the others are killed once these ended.
        scenarios: the module of the scenarios named without a module.
        pythonpath: folders the ranks need on their path to import the scenarios (e.g. a repository's root).
        fresh: start each rank as a new interpreter (``python -m lightning_rec.testing.worker``) even where it could
            be forked from the zygote (see :class:`_ForkedRank`): for what an interpreter's own start or exit
            decides (its finalisation at exit, modules imported at start, timings of a cold start).
        config: keyword arguments of the scenario (JSON).

    Returns:
        Each process and how it ended, and each rank's result.

    Example::

        run = launch("my_project.scenarios:fit", 2, tmp_path, pythonpath=[repo], steps=4)
        assert all(p.returncode == 0 for p in run.processes), run.log("rank1")
    """
    scenario = scenario_name(scenario)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base_env = {
        **{k: v for k, v in shell_env().items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))},
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join(filter(None, [*map(str, pythonpath), os.environ.get("PYTHONPATH")])),
    }
    procs: dict[str, Any] = {}
    logs, ended = {}, {}
    worker = command or _worker_command(scenario, out_dir, config, scenarios)
    forked = not fresh and command is None and launcher != "torchrun" and _zygote() is not None
    job_id = zlib.crc32(str(out_dir.resolve()).encode())  # SLURM's: one per job, kept when it is requeued
    for name, (argv, env) in _commands(launcher, worker, world_size, nodes, job_id).items():
        logs[name] = open(out_dir / f"{scenario}.{name}.log", "w")
        # Each rank works in the test's directory (anything written to the cwd lands there).
        if forked:
            procs[name] = _ForkedRank(argv[1:], {**base_env, **env}, out_dir, Path(logs[name].name))
        else:
            procs[name] = subprocess.Popen(
                argv, env={**base_env, **env}, cwd=out_dir, stdout=logs[name], stderr=subprocess.STDOUT
            )

    def watch(name: str) -> None:
        procs[name].wait()
        ended[name] = time.time()

    watchers = {name: threading.Thread(target=watch, args=(name,), daemon=True) for name in procs}
    for t in watchers.values():
        t.start()
    deadline = time.monotonic() + timeout
    try:
        for name in wait_for or list(procs):
            watchers[name].join(max(0.0, deadline - time.monotonic()))
    finally:
        running = {name: p.returncode is None and p.poll() is None for name, p in procs.items()}
        for name, p in procs.items():
            if running[name]:
                p.kill()
                p.wait()
        for f in logs.values():
            f.close()
    processes = [
        Process(
            name,
            None if running[name] else p.returncode,
            None if running[name] else ended.get(name),
            Path(logs[name].name).read_text(),
        )
        for name, p in procs.items()
    ]
    results = []
    for rank in range(world_size):
        path = out_dir / f"{scenario}.rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return Launch(processes, results)


def run_ranks(
    scenario: str | Callable[..., Any],
    world_size: int,
    out_dir: Path,
    timeout: float = 300,
    *,
    launcher: str = "env",
    nodes: int = 1,
    scenarios: str | None = None,
    pythonpath: Sequence[str] = (),
    fresh: bool = False,
    **config: Any,
) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world_size`` ranks (see :func:`launch`) and expect every process to succeed.

    Returns:
        each rank's result dict, in rank order.

    Raises:
        AssertionError: with every process's log, if any fails or the run exceeds ``timeout`` seconds.
    """
    run = launch(
        scenario,
        world_size,
        out_dir,
        launcher=launcher,
        nodes=nodes,
        timeout=timeout,
        scenarios=scenarios,
        pythonpath=pythonpath,
        fresh=fresh,
        **config,
    )
    results = [r for r in run.results if r is not None]
    if any(p.returncode != 0 for p in run.processes) or len(results) < len(run.results):
        raise AssertionError(
            f"scenario {scenario_name(scenario)!r} failed on {world_size} ranks (exit codes "
            f"{ {p.name: p.returncode for p in run.processes} }):\n"
            + "\n".join(f"----- {p.name} -----\n{p.log[-6000:]}" for p in run.processes)
        )
    return results


# --- Ranks forked from a zygote --------------------------------------------------------------------------------------
# A rank started as a new interpreter spends ~4 s of CPU importing torch, TorchRec, FBGEMM and Lightning before its
# scenario starts; a suite launches a few hundred. The zygote is multiprocessing's fork server with those imported
# once (its preload); each rank is forked from it: a real process of its own (its pid takes signals, its exit code is
# its scenario's), with the launcher's environment, working directory, log file and `sys.path`, and no thread or
# process group inherited (the fork server never runs one). At its end it runs what an interpreter runs at exit
# (non-daemon threads joined, atexit handlers), but not the interpreter's own finalisation: `fresh=True` for that.
# LIGHTNING_REC_FRESH_RANKS=1 starts every rank as a new interpreter.


def _zygote() -> Any:
    """The fork server's multiprocessing context (:mod:`lightning_rec._forkserver`), or ``None`` where there is none
    or LIGHTNING_REC_FRESH_RANKS=1."""
    if os.environ.get("LIGHTNING_REC_FRESH_RANKS") == "1":
        return None
    from lightning_rec._forkserver import forkserver_context

    return forkserver_context()


def _run_forked(argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """In the forked rank: become ``python <argv>`` started with ``env`` in ``cwd``, writing to ``log``."""
    import runpy
    import signal
    import warnings

    from lightning_rec._forkserver import RANK_SIGNALS

    # The zygote is a rank's helper, started with the job's signals blocked (lightning_rec._forkserver): a rank takes
    # them as a new interpreter would (SIGTERM and SIGUSR1 end it unless a handler is installed, SIGINT interrupts).
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, RANK_SIGNALS)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))
    assert argv[0] == "-m", argv
    sys.argv = [argv[1], *argv[2:]]
    code: Any = 0
    try:
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
    finally:
        from lightning_rec import _compat

        _compat.interpreter_exit()  # as the interpreter ends: threads told to stop and joined, then atexit handlers
    if code not in (0, None):
        raise SystemExit(code)


class _ForkedRank:
    """A rank forked from the zygote, with the part of ``subprocess.Popen``'s interface :func:`launch` uses."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
        context = _zygote()
        self._process = context.Process(target=_run_forked, args=(argv, env, str(cwd), str(log)), daemon=False)
        self._process.start()
        self.pid = self._process.pid
        self._lock = threading.Lock()  # the exit status is read from one pipe: one reader at a time

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        with self._lock:
            self._process.join(0)
        return self._process.exitcode

    def wait(self) -> int | None:
        while self.poll() is None:
            with self._lock:
                self._process.join(0.05)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()
