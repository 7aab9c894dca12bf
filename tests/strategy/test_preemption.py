"""Preemption as an operator meets it (issue 34, findings 1-3): real signals, skewed by tens of milliseconds, sent to
real rank processes in the middle of training; the job must stop at one step on every rank with a checkpoint, exit
non-zero with one line, and a restart with ``ckpt_path="last"`` must end with the weights of an uninterrupted run.

One launch per signal kind: SIGTERM (Kubernetes, spot) to ranks started like torchrun starts them, SIGUSR1 (SLURM's
requeue signal) to ranks started like ``srun`` starts them, with a stand-in ``scontrol`` on the PATH that records the
requeue. The uninterrupted run and the resumed runs share one module-scoped fixture each.
"""

from __future__ import annotations

import os
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
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_rec import RecShardStrategy
from lightning_rec.checkpoint import _layout as layout
from lightning_rec.checkpoint import is_checkpoint
from lightning_rec.data import SyntheticDataModule, SyntheticTable
from lightning_rec.testing import QUIET_TRAINER, FailAt
from tests.helpers.dist import REPO, Launch, launch
from tests.helpers.models import assemble, local_weights, tiny_dlrm

pytestmark = pytest.mark.dist

STEPS = 400  # long enough that the signals land mid-training (a step is a few ms here)
SKEW = 0.05  # seconds between the signal to one rank and to the other, as a cluster delivers them


class _Progress(Callback):
    """Writes ``<tag>.ready.rank<R>`` (with its pid) once the rank has trained a few steps."""

    def __init__(self, out: Path, tag: str) -> None:
        self.out, self.tag = out, tag

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 5:
            (self.out / f"{self.tag}.ready.rank{trainer.global_rank}").write_text(str(os.getpid()))


def fit(
    rank: int, world_size: int, out_dir: Path, tag: str, resume: bool = False, save_every: int = 0, kill_at: int = 0
) -> dict[str, Any]:
    """A DLRM on synthetic data, ``STEPS`` steps, checkpoints in ``out_dir/root`` (resumed with ``"last"``; with
    ``save_every``, a ``ModelCheckpoint`` saving that often, so that a signal is likely to land in a save; with
    ``kill_at``, rank 1 SIGKILLs itself at that step once, after a checkpoint every 50 steps)."""
    if kill_at:
        save_every = 50
    out = Path(out_dir)
    L.seed_everything(0)
    dm = SyntheticDataModule(
        [SyntheticTable("item", 200, distribution="power_law"), SyntheticTable("tags", 30, multi_hot=True)],
        num_dense_features=2,
        train_rows=STEPS * 8 * world_size,
        val_rows=16,
        batch_size=8,
    )
    model = tiny_dlrm(dm)
    trainer = L.Trainer(
        strategy=RecShardStrategy(),
        accelerator="cpu",
        devices=world_size,
        max_steps=STEPS,
        limit_val_batches=0,
        default_root_dir=str(out / "root"),
        callbacks=[_Progress(out, tag)]
        + ([ModelCheckpoint(every_n_train_steps=save_every, save_top_k=1)] if save_every else [])
        + ([FailAt(1, kill_at, "kill", out, once=True)] if kill_at else []),
        **{**QUIET_TRAINER, "use_distributed_sampler": True, "enable_checkpointing": bool(save_every)},
    )
    trainer.fit(model, dm, ckpt_path="last" if resume else None)
    torch.save(local_weights(model), out / f"{tag}.weights{rank}.pt")
    return {"global_step": trainer.global_step}


def _weights(out: Path, tag: str, world_size: int = 2) -> dict[str, torch.Tensor]:
    return assemble([torch.load(out / f"{tag}.weights{r}.pt") for r in range(world_size)])


def _interrupted(
    out: Path, tag: str, signum: int, launcher: str, env: dict[str, str] | None = None, first: int = 1, **config: Any
) -> Launch:
    """Launch :func:`fit` on 2 ranks, wait until both trained a few steps, signal rank ``first`` then (``SKEW``
    later) the other, and return how the ranks ended."""
    result: dict[str, Launch] = {}
    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        runner = threading.Thread(
            target=lambda: result.setdefault(
                "run", launch(fit, 2, out, launcher=launcher, timeout=240, tag=tag, **config)
            )
        )
        runner.start()
        ready = [out / f"{tag}.ready.rank{r}" for r in range(2)]
        deadline = time.monotonic() + 180
        while not all(p.exists() and p.read_text() for p in ready) and runner.is_alive():
            assert time.monotonic() < deadline, "the ranks never reached step 5"
            time.sleep(0.01)  # polling for the ranks' marker files, not a synchronisation by time
        pids = [int(p.read_text()) for p in ready]
        os.kill(pids[first], signum)
        time.sleep(SKEW)  # the skew itself is what is being tested
        os.kill(pids[1 - first], signum)
        runner.join()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return result["run"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("uninterrupted")
    run = launch(fit, 2, out, timeout=240, tag="ref")
    assert all(p.returncode == 0 for p in run.processes), run.processes
    return _weights(out, "ref")


def _check_preempted(run: Launch, out: Path, signum: int) -> Path:
    """Every rank exited ``128 + signum``, saying where it stopped, all at the same step, with one checkpoint."""
    name = signal.Signals(signum).name
    codes = {p.name: p.returncode for p in run.processes}
    assert codes == {"rank0": 128 + signum, "rank1": 128 + signum}, "\n".join(p.log[-3000:] for p in run.processes)
    lines = [next(line for line in p.log.splitlines() if f"preempted by {name} at step" in line) for p in run.processes]
    steps = {line.split(" at step ")[1].split(";")[0] for line in lines}
    assert len(steps) == 1, lines  # every rank stopped after the same step
    ckpts = sorted((out / "root").glob("hpc_ckpt_*.ckpt"))
    assert len(ckpts) == 1 and is_checkpoint(ckpts[0]) and str(ckpts[0]) in lines[0], (ckpts, lines)
    assert not list((out / "root").rglob(layout.WORK_DIR)), "no staging directory left anywhere"
    assert 5 <= int(steps.pop()) < STEPS
    return ckpts[0]


def test_sigterm_to_skewed_ranks_saves_at_one_step_exits_143_and_resumes_exactly(reference, tmp_path):
    # A checkpoint every step: the signals land in a save as often as not (Lightning's handler deadlocked there).
    run = _interrupted(tmp_path, "term", signal.SIGTERM, "env", save_every=1)
    _check_preempted(run, tmp_path, signal.SIGTERM)
    # The restart (torchrun --max-restarts, an operator re-running the command) with ckpt_path="last".
    resumed = launch(fit, 2, tmp_path, timeout=240, tag="resumed", resume=True)
    assert all(p.returncode == 0 for p in resumed.processes), resumed.processes[0].log[-3000:]
    assert "ckpt_path='last': resuming from" in resumed.processes[0].log
    assert [r["global_step"] for r in resumed.results] == [STEPS, STEPS]
    got = _weights(tmp_path, "resumed")
    assert got.keys() == reference.keys()
    for key in reference:
        assert torch.equal(got[key], reference[key]), key


def test_slurm_requeue_signal_saves_requeues_once_exits_138_and_the_requeued_job_resumes(reference, tmp_path):
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/requeued\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{scontrol.parent}{os.pathsep}{os.environ['PATH']}"}
    run = _interrupted(tmp_path, "usr1", signal.SIGUSR1, "slurm", env, first=0)
    _check_preempted(run, tmp_path, signal.SIGUSR1)
    job = (tmp_path / "requeued").read_text().splitlines()
    assert len(job) == 1 and job[0].startswith("requeue "), job  # rank 0 alone requeued the job
    # The requeued job runs the same command, no ckpt_path: Lightning's SLURM resume takes the hpc checkpoint.
    requeued = launch(fit, 2, tmp_path, launcher="slurm", timeout=240, tag="requeued")
    assert all(p.returncode == 0 for p in requeued.processes), requeued.processes[0].log[-3000:]
    got = _weights(tmp_path, "requeued")
    assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in reference)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_signal_outside_training_ends_the_process_as_the_signal_does(tmp_path):
    """``validate``/``predict`` have nothing to save: the signal's own default action, never a hang or exit 0."""
    code = (
        "import os, signal, lightning as L, torch\n"
        "from torch.utils.data import DataLoader\n"
        "from lightning_rec import RecShardStrategy\n"
        "from lightning_rec.testing import QUIET_TRAINER\n"
        "from tests.helpers.models import RecModel, make_batches\n"
        "class Kill(L.Callback):\n"
        "    def on_validation_batch_start(self, *a):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "m = RecModel()\n"
        "t = L.Trainer(strategy=RecShardStrategy(), accelerator='cpu', devices=1, callbacks=[Kill()], **QUIET_TRAINER)\n"
        "t.validate(m, DataLoader(make_batches(4, 8, seed=0), batch_size=None))\n"
        "print('survived')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
    assert "survived" not in done.stdout


# --- torchrun --max-restarts: a rank killed, the group restarted, ckpt_path="last" ----------------------------------


def test_a_torchrun_job_restarted_after_a_kill_ends_with_the_weights_of_an_uninterrupted_one(reference, tmp_path):
    """torchrun restarts the whole group when rank 1 is SIGKILLed (after a checkpoint at step 50); the restarted
    ranks run the same command, ``fit(ckpt_path="last")``, and must end where the uninterrupted run ended. (With
    ``--rdzv-backend=c10d`` a restarted gloo group fails to connect in ``init_process_group`` on torch 2.13, plain
    torch too: the static rendezvous, torchrun's default, is what restarts here.)"""
    import json

    from lightning_rec.testing.ports import free_port, shell_env

    config = {"tag": "restarted", "resume": True, "kill_at": 60}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--monitor-interval=0.5",
        "-m", "lightning_rec.testing.worker", f"{__name__}:fit", json.dumps(config), str(tmp_path),
    ]  # fmt: skip
    env = {**shell_env(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "failed.rank1").exists(), "rank 1 was killed once"
    assert "ckpt_path='last': resuming from" in done.stdout + done.stderr
    got = _weights(tmp_path, "restarted")
    assert got.keys() == reference.keys()
    for key in reference:
        assert torch.equal(got[key], reference[key]), key
