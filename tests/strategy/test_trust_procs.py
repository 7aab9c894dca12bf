"""Signals and processes as a scheduler treats a job (issue 51, items 4, 5 and 8): a signal goes to *every* process
of the job (SLURM's ``scancel``/``--signal`` without ``B:``), a rank is killed with ``kill -9``, a pod's first
process (torchrun's agent) gets SIGTERM. Each rank has 2 DataLoader workers, forked from its own fork server.

- Only the ranks act on a signal: the workers, the fork server and the resource tracker leave it to them; the job
  saves once, exits with its documented code (138 and a requeue for SLURM's SIGUSR1, 143 for SIGTERM) and resumes to
  the weights of an uninterrupted run; a copy of the signal that reaches a rank after the save still ends it with 143.
- A rank killed with ``kill -9`` leaves none of its processes behind.
- torchrun's agent stopped by SIGTERM says so in one line, not a traceback.

Processes are followed through ``/proc`` (Linux); every wait polls with a deadline.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_rec import RecShardStrategy
from lightning_rec.checkpoint import is_checkpoint
from lightning_rec.data import SyntheticDataModule, SyntheticTable
from lightning_rec.errors import Preempted
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.dist import REPO, Launch, launch
from tests.helpers.models import assemble, local_weights, tiny_dlrm

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="processes followed through /proc"),
]

STEPS = 240  # long enough that the signals land mid-training (a step is a few ms here, more with workers)
SKEW = 0.05  # seconds between the signal to one rank's processes and to the other's, as a cluster delivers them
WORKERS = 2


# --- processes, through /proc ------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """``(state, ppid, session, start time)`` of ``pid``, or ``None`` if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[3]), int(fields[19])


def _processes() -> dict[int, tuple[str, int, int, int]]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _stat(int(entry))) is not None:
            found[int(entry)] = info
    return found


def _descendants(pid: int) -> dict[int, int]:
    """``{pid: start time}`` of every living descendant of ``pid`` (not ``pid`` itself)."""
    table = _processes()
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for child, (state, ppid, _, start) in table.items():
            if ppid == parent and child not in out and state != "Z":
                out[child] = start
                todo.append(child)
    return out


def _living(pids: dict[int, int]) -> list[int]:
    """Those of ``pids`` still running (the same process: same start time; a zombie has ended)."""
    return [p for p, start in pids.items() if (s := _stat(p)) is not None and s[0] != "Z" and s[3] == start]


def _session(sid: int) -> list[int]:
    return [p for p, (state, _, session, _) in _processes().items() if session == sid and state != "Z"]


def _poll(condition: Any, seconds: float, what: str) -> float:
    """Wait until ``condition()`` is true; the seconds it took (fails after ``seconds``)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < seconds, f"{what}: not within {seconds} s"
        time.sleep(0.05)  # polling a condition, with a deadline
    return time.monotonic() - start


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _has_workers(rank: int) -> bool:
    """The rank runs its fork server with ``WORKERS`` DataLoader workers forked from it."""
    tree = _descendants(rank)
    servers = [p for p in tree if "forkserver" in _cmdline(p) and _stat(p) and _stat(p)[1] == rank]  # type: ignore[index]
    return any(sum(1 for p in tree if (s := _stat(p)) and s[1] == server) >= WORKERS for server in servers)


def _signal_everything(pid: int, signum: int) -> int:
    """``signum`` to ``pid`` and all its descendants, helpers first (a scheduler's order is any): how many got it."""
    targets = [*_descendants(pid), pid]
    for target in targets:
        try:
            os.kill(target, signum)
        except ProcessLookupError:
            pass
    return len(targets)


# --- the job: a DLRM whose data comes from 2 workers per rank --------------------------------------------------


class _Progress(Callback):
    """Writes ``<tag>.ready.rank<R>`` (with its pid) once the rank has trained a few steps (its workers run)."""

    def __init__(self, out: Path, tag: str) -> None:
        self.out, self.tag = out, tag

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 5:
            (self.out / f"{self.tag}.ready.rank{trainer.global_rank}").write_text(str(os.getpid()))


class _LateSignal(Callback):
    """Sends this rank's process ``SIGTERM`` again once the ranks stopped: what a rank told 0.5-1 s after the others
    gets (then once more after the fit, below)."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, Preempted):
            os.kill(os.getpid(), signal.SIGTERM)


def fit(
    rank: int, world_size: int, out_dir: Path, tag: str, workers: int = WORKERS, resume: bool = False, late: int = -1
) -> dict[str, Any]:
    """``STEPS`` steps of a small DLRM on synthetic data with ``workers`` DataLoader workers per rank, checkpoints in
    ``out_dir/root`` (resumed with ``"last"``); rank ``late`` gets its signal again after the stop."""
    out = Path(out_dir)
    L.seed_everything(0)
    dm = SyntheticDataModule(
        [SyntheticTable("item", 200, distribution="power_law"), SyntheticTable("tags", 30, multi_hot=True)],
        num_dense_features=2,
        train_rows=STEPS * 8 * world_size,
        val_rows=16,
        batch_size=8,
        num_workers=workers,
    )
    model = tiny_dlrm(dm)
    trainer = L.Trainer(
        strategy=RecShardStrategy(),
        accelerator="cpu",
        devices=world_size,
        max_steps=STEPS,
        limit_val_batches=0,
        default_root_dir=str(out / "root"),
        callbacks=[_Progress(out, tag)] + ([_LateSignal()] if rank == late else []),
        **{**QUIET_TRAINER, "use_distributed_sampler": True, "enable_checkpointing": False},
    )
    try:
        trainer.fit(model, dm, ckpt_path="last" if resume else None)
    except Preempted:
        if rank == late:  # after Lightning's teardown put its handlers back
            os.kill(os.getpid(), signal.SIGTERM)
        raise
    torch.save(local_weights(model), out / f"{tag}.weights{rank}.pt")
    return {"global_step": trainer.global_step}


def _weights(out: Path, tag: str) -> dict[str, torch.Tensor]:
    return assemble([torch.load(out / f"{tag}.weights{r}.pt") for r in range(2)])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run's weights (no workers: the batches are the same; the resumed runs must match it)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run = launch(fit, 2, out, timeout=300, tag="ref", workers=0)
    assert all(p.returncode == 0 for p in run.processes), run.processes[0].log[-3000:]
    return _weights(out, "ref")


def _scancel(
    out: Path, tag: str, signum: int, launcher: str, env: dict[str, str] | None = None, **config: Any
) -> Launch:
    """Launch :func:`fit` on 2 ranks, wait until both train with their workers, then send ``signum`` to every process
    of rank 0 (workers, fork server, resource tracker, the rank) and, ``SKEW`` later, of rank 1."""
    result: dict[str, Launch] = {}
    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        runner = threading.Thread(
            target=lambda: result.setdefault(
                "run", launch(fit, 2, out, launcher=launcher, timeout=300, tag=tag, **config)
            )
        )
        runner.start()
        ready = [out / f"{tag}.ready.rank{r}" for r in range(2)]
        _poll(lambda: all(p.exists() and p.read_text() for p in ready) or not runner.is_alive(), 240, "step 5")
        pids = [int(p.read_text()) for p in ready]
        _poll(lambda: all(_has_workers(pid) for pid in pids), 60, f"{WORKERS} workers on each rank")
        signalled = _signal_everything(pids[0], signum)
        time.sleep(SKEW)  # the skew itself is part of what is tested
        signalled += _signal_everything(pids[1], signum)
        assert signalled >= 2 * (2 + WORKERS), signalled  # each rank, its fork server and workers (and tracker)
        runner.join()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return result["run"]


def _check_preempted(run: Launch, out: Path, signum: int) -> None:
    name = signal.Signals(signum).name
    codes = {p.name: p.returncode for p in run.processes}
    assert codes == {"rank0": 128 + signum, "rank1": 128 + signum}, "\n".join(p.log[-3000:] for p in run.processes)
    for p in run.processes:
        assert "exited unexpectedly" not in p.log, p.log[-3000:]
        assert f"preempted by {name} at step" in p.log
    ckpts = sorted((out / "root").glob("hpc_ckpt_*.ckpt"))
    assert len(ckpts) == 1 and is_checkpoint(ckpts[0]), ckpts


def _check_resumed(reference: dict[str, torch.Tensor], out: Path, tag: str) -> None:
    got = _weights(out, tag)
    assert got.keys() == reference.keys()
    for key in reference:
        assert torch.equal(got[key], reference[key]), key


def test_scancel_usr1_to_every_process_of_a_slurm_job_saves_requeues_and_resumes(reference, tmp_path):
    """SLURM's requeue signal to the ranks *and* their workers, fork servers and trackers: saved, 138 on both ranks,
    one requeue, and the requeued job (same command, no ckpt_path) ends with the uninterrupted run's weights."""
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/requeued\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{scontrol.parent}{os.pathsep}{os.environ['PATH']}"}
    run = _scancel(tmp_path, "usr1", signal.SIGUSR1, "slurm", env)
    _check_preempted(run, tmp_path, signal.SIGUSR1)
    assert len((tmp_path / "requeued").read_text().splitlines()) == 1
    requeued = launch(fit, 2, tmp_path, launcher="slurm", timeout=300, tag="requeued")
    assert all(p.returncode == 0 for p in requeued.processes), requeued.processes[0].log[-3000:]
    _check_resumed(reference, tmp_path, "requeued")


def test_sigterm_to_every_process_saves_exits_143_even_when_signalled_again_and_resumes(reference, tmp_path):
    """SIGTERM to every process of the job; rank 1 gets it again after the ranks stopped (during its exit and after
    Lightning's teardown): still 143, not death by the signal (-15)."""
    run = _scancel(tmp_path, "term", signal.SIGTERM, "env", late=1)
    _check_preempted(run, tmp_path, signal.SIGTERM)
    resumed = launch(fit, 2, tmp_path, timeout=300, tag="resumed", resume=True)
    assert all(p.returncode == 0 for p in resumed.processes), resumed.processes[0].log[-3000:]
    _check_resumed(reference, tmp_path, "resumed")


# --- kill -9: nothing of the rank is left -------------------------------------------------------------------------

CONFIG = """\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 2
  strategy: recshard
  max_steps: 100000
  limit_val_batches: 0
  num_sanity_val_steps: 0
  enable_progress_bar: false
  logger: false
  enable_checkpointing: false
  default_root_dir: {root}
model:
  class_path: lightning_rec.models.DLRMModule
  init_args:
    embedding_dim: 8
    dense_arch_layer_sizes: [8]
    over_arch_layer_sizes: [8, 1]
data:
  class_path: lightning_rec.data.SyntheticDataModule
  init_args:
    tables:
      - {{name: item, num_embeddings: 200}}
      - {{name: tags, num_embeddings: 30, multi_hot: true}}
    num_dense_features: 2
    train_rows: 4000
    val_rows: 16
    batch_size: 8
    num_workers: {workers}
"""


def _cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}


def test_a_rank_killed_with_sigkill_leaves_none_of_its_processes_behind(tmp_path):
    """``lightning-rec fit`` on 2 ranks (Lightning's launcher: rank 1 is rank 0's child) with 2 workers each; rank 1
    is SIGKILLed mid-training: its workers, fork server and resource tracker are gone within 10 s, and then the
    whole job (rank 0 fails on the lost peer and ends with its own helpers)."""
    config = tmp_path / "job.yaml"
    config.write_text(CONFIG.format(root=tmp_path / "root", workers=WORKERS))
    log = open(tmp_path / "job.log", "w")
    job = subprocess.Popen(
        [sys.executable, "-m", "lightning_rec", "fit", "--config", str(config)],
        cwd=tmp_path, env=_cli_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:

        def rank1() -> int | None:
            children = [p for p in _descendants(job.pid) if _stat(p)[1] == job.pid and " fit " in _cmdline(p)]  # type: ignore[index]
            return children[0] if children else None

        _poll(lambda: job.poll() is None and (r := rank1()) is not None and _has_workers(r) and _has_workers(job.pid), 240, "2 ranks with their workers")  # fmt: skip
        victim = rank1()
        assert victim is not None
        helpers = _descendants(victim)
        assert len(helpers) >= 1 + WORKERS, helpers  # the fork server and its workers (and the resource tracker)
        os.kill(victim, signal.SIGKILL)
        took = _poll(lambda: not _living(helpers), 10, f"rank 1's processes {_living(helpers)} after kill -9")
        print(f"rank 1's {len(helpers)} processes gone {took:.1f} s after its kill -9")
        job.wait(timeout=120)  # rank 0 fails on the lost peer
        _poll(lambda: not _session(job.pid), 10, f"the job's processes {_session(job.pid)} after rank 0 ended")
        assert job.returncode not in (0, None)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        log.close()


# --- torchrun's agent stopped by SIGTERM (a Kubernetes pod's first process) ------------------------------------------


def test_under_torchrun_a_killed_rank_leaves_nothing_and_a_sigterm_to_the_agent_ends_in_one_line(tmp_path):
    """One torchrun job (``python -m lightning_rec.integrations.torchrun``, torchrun's own arguments,
    ``--max-restarts=1``), 2 ranks with 2 workers each. A rank is SIGKILLed: its workers, fork server and resource
    tracker are gone within 10 s, and the agent restarts the group. Then the agent alone gets SIGTERM, as a pod's
    first process does: the restarted ranks save and exit 143, the agent says so in one line and exits 143 (torchrun:
    a ``SignalException`` traceback, exit 1), and nothing of the job is left."""
    from lightning_rec.testing.ports import free_port

    config = tmp_path / "job.yaml"
    config.write_text(CONFIG.format(root=tmp_path / "root", workers=WORKERS))
    command = [
        sys.executable, "-m", "lightning_rec.integrations.torchrun", "--nproc-per-node=2", "--max-restarts=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--monitor-interval=0.5",
        "-m", "lightning_rec", "fit", "--config", str(config),
    ]  # fmt: skip
    err = open(tmp_path / "agent.err", "w")
    agent = subprocess.Popen(
        command, cwd=tmp_path, env={**_cli_env(), "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=err,
        start_new_session=True,
    )  # fmt: skip
    helpers: dict[int, int] = {}
    job: dict[int, int] = {}
    try:

        def ranks() -> list[int]:
            return [p for p in _descendants(agent.pid) if _stat(p)[1] == agent.pid and " fit " in _cmdline(p)]  # type: ignore[index]

        def training(exclude: set[int]) -> bool:
            found = [r for r in ranks() if r not in exclude]
            return agent.poll() is None and len(found) == 2 and all(map(_has_workers, found))

        _poll(lambda: training(set()), 240, "2 ranks with their workers")
        first = set(ranks())
        victim = max(first)
        helpers = _descendants(victim)
        assert len(helpers) >= 1 + WORKERS, helpers  # the fork server and its workers (and the resource tracker)
        os.kill(victim, signal.SIGKILL)
        took = _poll(lambda: not _living(helpers), 10, f"the killed rank's processes {_living(helpers)}")
        print(f"under torchrun, the killed rank's {len(helpers)} processes gone {took:.1f} s after its kill -9")
        _poll(lambda: training(first), 240, "the restarted ranks with their workers")
        job = _descendants(agent.pid)  # torchrun starts each rank in a session of its own: followed by pid
        os.kill(agent.pid, signal.SIGTERM)
        agent.wait(timeout=120)
        took = _poll(lambda: not _living(job), 10, f"the job's processes {_living(job)} after the agent")
        print(f"the job's {len(job)} processes gone {took:.1f} s after the agent")
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        for pid in _living({**helpers, **job}):
            os.kill(pid, signal.SIGKILL)  # what a failed run of this test left (ranks are not in the agent's group)
        err.close()
    stderr = (tmp_path / "agent.err").read_text()
    assert agent.returncode == 143, stderr[-4000:]
    assert "SignalException" not in stderr, stderr[-4000:]
    stops = re.findall(r"\[rank (\d)\] preempted by SIGTERM at step (\d+); checkpoint (\S+)", stderr)
    assert sorted(rank for rank, _, _ in stops) == ["0", "1"], stderr[-4000:]
    assert len({(step, path) for _, step, path in stops}) == 1 and is_checkpoint(Path(stops[0][2])), stops
    end = stderr[stderr.rindex("preempted by SIGTERM at step") :]  # the agent's end, after the restarted ranks'
    assert "Traceback" not in end, end
    assert "torchrun: stopped by SIGTERM; its ranks were passed the signal and have ended (exit 143)" in end


# --- a full disk: said first, in one line ---------------------------------------------------------------------------


def test_a_full_disk_is_said_in_one_line_before_any_traceback(tmp_path):
    """A checkpoint save that fills the disk (a 64 KB tmpfs) stops the job; the first thing on stderr about it is
    one line naming the file, what it needs and what is free, not the end of ~300 lines of tracebacks."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        config = tmp_path / "job.yaml"
        text = CONFIG.format(root=disk, workers=0).replace("enable_checkpointing: false", "enable_checkpointing: true")
        text = text.replace("max_steps: 100000", "max_steps: 40").replace("  logger: false\n", "  logger: false\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n      init_args: {every_n_train_steps: 10, save_top_k: -1}\n")  # fmt: skip
        config.write_text(text)
        done = subprocess.run(
            [sys.executable, "-m", "lightning_rec", "fit", "--config", str(config), "--trainer.devices=2"],
            cwd=tmp_path, env=_cli_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    lines = done.stderr.splitlines()
    said = [i for i, line in enumerate(lines) if "no space left on device writing" in line]
    assert done.returncode != 0 and said, done.stderr[-4000:]
    first = lines[said[0]]
    assert first.startswith("[rank ") and "needs ~" in first and "MB free" in first and "--ckpt_path=last" in first
    tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback") or "Traceback (most" in line]
    assert not tracebacks or said[0] < tracebacks[0], "\n".join(lines[: said[0] + 1])[-3000:]
