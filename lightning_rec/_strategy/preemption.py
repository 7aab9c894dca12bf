"""Preemption: a signal becomes a checkpoint at the next step boundary, then a non-zero exit.

What a fleet does to a job: SLURM sends ``SIGUSR1`` (its requeue signal) some time before the end of a job's slot,
Kubernetes and spot instances send ``SIGTERM``, and both reach the ranks a few milliseconds apart. Lightning's own
handlers act *inside* the signal handler: its SLURM handler saves a checkpoint there, and its SIGTERM handler
broadcasts, i.e. both start a collective in the middle of whatever collective the interrupted rank was in (an
embedding all-to-all, a checkpoint save), while the other rank waits in another: a deadlock until the collective
timeout. And its ``SIGTERMException`` is a ``SystemExit()`` whose exit status is 0, so an orchestrator records the
preempted job as succeeded.

Here a signal only sets a flag (:class:`Preemption`, installed over Lightning's handlers for the time of a
``fit``/``validate``/``test``/``predict``). The ranks compare their flags at training-batch boundaries (where
``ModelCheckpoint`` saves), about every 50 ms: an all-reduce of host integers on a gloo group of its own, started
asynchronously and read at the next comparison, so no device tensor is read and a step rarely pays for it. Once
agreed, every rank saves Lightning's "hpc" checkpoint (``<default_root_dir>/hpc_ckpt_<n>.ckpt``, the one SLURM's requeue resumes
from) with the normal collective save, rank 0 requeues the SLURM job when Lightning's SLURM auto-requeue is on, and
every rank exits with ``128 + signal`` (143 for SIGTERM, 138 for SIGUSR1) after one line: ``preempted by SIGTERM at
step N; checkpoint ...``. ``fit(ckpt_path="last")`` (and the CLI's ``--ckpt_path=last``) resume from it.

A signal that arrives once the ranks agreed to stop (another copy of it, a rank told later than the others, the
scheduler's SIGTERM after its requeue signal) changes nothing: the rank ends with the exit code above, never killed
by the signal (-15), however late in its exit the signal lands (the handler outlives the stage; Lightning would put
back the default one).

Outside training (sanity check, ``validate``/``test``/``predict``) there is nothing to save: the signal's default
action is restored and the signal raised again, so the process ends as that signal ends it (non-zero).

Only the ranks act: the job's other processes (DataLoader workers, the fork server, the resource tracker), which a
scheduler signals too, leave these signals alone (:mod:`lightning_rec._forkserver`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_rec import _compat
from lightning_rec._compat.lightning import restore_after_stage
from lightning_rec.errors import Preempted

__all__ = ["Preemption"]


def _requeue_signal(trainer: pl.Trainer) -> signal.Signals:
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if isinstance(environment, SLURMEnvironment) and environment.requeue_signal is not None:
        return signal.Signals(environment.requeue_signal)
    return signal.SIGUSR1


def _slurm_requeue(trainer: pl.Trainer) -> bool:
    environment = getattr(trainer.strategy, "cluster_environment", None)
    return isinstance(environment, SLURMEnvironment) and environment.auto_requeue


_MAX_GAP = 1000  # batches between two rounds at most


def _no_broadcast() -> None:
    """Lightning's per-batch SIGTERM broadcast, replaced by :meth:`Preemption.agreed`."""


class Preemption(Callback):
    """The strategy's signal handling (see the module docstring): one per strategy, added to the trainer's
    callbacks by :class:`~lightning_rec.RecShardStrategy` at ``setup``.

    Example::

        preemption = Preemption()
        preemption.start(world_size=2)          # every rank, once the process group runs (a gloo group of its own)
        preemption.attach(trainer)              # then SIGTERM/SIGUSR1 stop the fit at a batch boundary
    """

    INTERVAL = 0.05  # seconds between two comparisons of the ranks' flags (about)

    def __init__(self) -> None:
        self.received = 0  # the first signal's number, set by the handler
        self._training = False
        self._stopping = False  # the ranks agreed to stop: later signals change nothing
        self._group: Any = None
        self._pending: Any = None  # the all-reduce started after the last batch
        self._flag = torch.zeros(2, dtype=torch.int64)  # [signal, rank 0's next gap], all-reduced (max)
        self._signals: tuple[signal.Signals, ...] = ()
        self._batches, self._next_round = 0, 1  # training batches ended; the one at which the ranks compare next
        self._last: float | None = None
        self._batch_seconds: float | None = None

    def attach(self, trainer: pl.Trainer) -> None:
        """Join ``trainer``'s callbacks (once) and switch off Lightning's per-batch SIGTERM broadcast, which this
        replaces (a device tensor read back after every batch with several ranks)."""
        # (Lightning's callback connector sets `Trainer.callbacks`; the Trainer class does not declare it.)
        callbacks: list = trainer.callbacks  # type: ignore[attr-defined]
        if self not in callbacks:
            callbacks.append(self)
        _compat.patch_method(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor", _no_broadcast)

    def start(self, world_size: int, timeout: timedelta | None = None) -> None:
        """Make the ranks' group for agreeing on a signal (every rank, after the process group started), with the
        strategy's collective ``timeout``: a rank that hangs is given up on after it here too."""
        self._group = dist.new_group(backend="gloo", timeout=timeout) if world_size > 1 else None

    # --- the handler ---

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._training or self._stopping:
            self.received = self.received or signum
            return
        signal.signal(signum, signal.SIG_DFL)  # nothing to save: end as the signal ends a process
        os.kill(os.getpid(), signum)

    def _install(self, trainer: pl.Trainer) -> None:
        if threading.current_thread() is not threading.main_thread() or sys.platform == "win32":
            return
        # Over Lightning's handlers (registered just before the stage runs; its teardown restores what was there).
        self._signals = (signal.SIGTERM, _requeue_signal(trainer))
        self._stopping = False  # a new stage (a fit after a preemption caught)
        for signum in self._signals:
            signal.signal(signum, self._handler)

    # --- when the handlers are ours ---

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)
        self.received, self._pending = 0, None
        self._batches, self._next_round, self._last, self._batch_seconds = 0, 1, None, None
        self._training = True

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._training = False
        if self._pending is not None:  # every rank started it after the same last batch
            self._pending.wait()
            self._pending = None

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    on_test_start = on_predict_start = on_validation_start

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._training = False
        self._pending = None

    # --- the step boundary ---

    def agreed(self) -> int:
        """The signal every rank agrees was received (0: none); every rank calls it after each training batch.

        The ranks compare flags every ``gap`` batches, ``gap`` chosen by rank 0 so that a round comes about every
        :attr:`INTERVAL` seconds (one batch apart when batches are slower than that): a round costs about what a
        small collective costs (0.3-0.5 ms on 2 CPU ranks here), too much for every 2 ms step. Each round is an
        all-reduce (max) of two host integers, the signal and rank 0's next ``gap``, started asynchronously and read
        at the next round, so every rank knows the same schedule. Reads no device tensor."""
        if self._group is None:
            return self.received
        self._batches += 1
        now = time.perf_counter()
        if self._last is not None:  # rank 0's batch time, smoothed: what the next gap is made of
            seconds = now - self._last
            self._batch_seconds = seconds if self._batch_seconds is None else 0.8 * self._batch_seconds + 0.2 * seconds
        self._last = now
        if self._batches < self._next_round:
            return 0
        result, gap = 0, 1
        if self._pending is not None:
            self._pending.wait()
            result, gap = (int(v) for v in self._flag.tolist())  # CPU tensor: no device sync
        proposal = 0
        if dist.get_rank(self._group) == 0 and self._batch_seconds:
            proposal = max(1, min(_MAX_GAP, int(self.INTERVAL / self._batch_seconds)))
        self._flag = torch.tensor([self.received, proposal], dtype=torch.int64)
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._next_round = self._batches + max(1, gap)
        return result

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        signum = self.agreed()
        if not signum:
            return
        self._pending = None  # (signals keep landing on the flag while the checkpoint is saved)
        self._stopping = True  # from here on, the exit code below is this rank's, whatever signal comes
        restore_after_stage(trainer, {s: self._handler for s in self._signals})
        path = Path(_compat.hpc_save_path(trainer.default_root_dir))
        trainer.save_checkpoint(path)  # every rank: the normal collective save
        name = signal.Signals(signum).name
        requeued = ""
        if _slurm_requeue(trainer) and signum != signal.SIGTERM:
            requeued = "; SLURM job requeued" if _requeue_slurm_job(trainer.global_rank) else "; requeue failed"
        message = (
            f"[rank {trainer.global_rank}] preempted by {name} at step {trainer.global_step}; "
            f"checkpoint {path}{requeued} (resume: fit(ckpt_path='last'), or `--ckpt_path=last`)"
        )
        print(message, file=sys.stderr, flush=True)
        raise Preempted(message, 128 + signum)


def _requeue_slurm_job(rank: int) -> bool:
    """``scontrol requeue`` this job (rank 0; the others report success)."""
    if rank != 0:
        return True
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    scontrol = shutil.which("scontrol")
    if not job or scontrol is None:
        rank_zero_warn("preempted under SLURM, but `scontrol` or SLURM_JOB_ID is missing: the job was not requeued.")
        return False
    return subprocess.call([scontrol, "requeue", job]) == 0
