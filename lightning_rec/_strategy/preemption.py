"""Preemption: a signal becomes a checkpoint at the next step boundary, then a non-zero exit.

What a fleet does to a job: SLURM sends ``SIGUSR1`` (its requeue signal) some time before the end of a job's slot,
Kubernetes and spot instances send ``SIGTERM``, and both reach the ranks a few milliseconds apart. Lightning's own
handlers act *inside* the signal handler: its SLURM handler saves a checkpoint there, and its SIGTERM handler
broadcasts, i.e. both start a collective in the middle of whatever collective the interrupted rank was in (an
embedding all-to-all, a checkpoint save), while the other rank waits in another: a deadlock until the collective
timeout. And its ``SIGTERMException`` is a ``SystemExit()`` whose exit status is 0, so an orchestrator records the
preempted job as succeeded.

Here a signal only sets a flag (:class:`Preemption`, installed over Lightning's handlers for the time of a
``fit``/``validate``/``test``/``predict``). The ranks agree on the flag after each training batch (where
``ModelCheckpoint`` saves): an all-reduce of one host integer on a gloo group of its own, started asynchronously
after one batch and read after the next, so no rank waits for it and no device tensor is read. Once agreed, every
rank saves Lightning's "hpc" checkpoint (``<default_root_dir>/hpc_ckpt_<n>.ckpt``, the one SLURM's requeue resumes
from) with the normal collective save, rank 0 requeues the SLURM job when Lightning's SLURM auto-requeue is on, and
every rank exits with ``128 + signal`` (143 for SIGTERM, 138 for SIGUSR1) after one line: ``preempted by SIGTERM at
step N; checkpoint ...``. ``fit(ckpt_path="last")`` (and the CLI's ``--ckpt_path=last``) resume from it.

Outside training (sanity check, ``validate``/``test``/``predict``) there is nothing to save: the signal's default
action is restored and the signal raised again, so the process ends as that signal ends it (non-zero).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
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


class Preemption(Callback):
    """The strategy's signal handling (see the module docstring): one per strategy, added to the trainer's
    callbacks by :class:`~lightning_rec.RecShardStrategy` at ``setup``.

    Example::

        preemption = Preemption()
        preemption.start(world_size=2)          # every rank, once the process group runs (a gloo group of its own)
        trainer.callbacks.append(preemption)    # then SIGTERM/SIGUSR1 stop the fit at a batch boundary
    """

    def __init__(self) -> None:
        self.received = 0  # the first signal's number, set by the handler
        self._training = False
        self._group: Any = None
        self._pending: Any = None  # the all-reduce started after the last batch
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._signals: tuple[signal.Signals, ...] = ()

    def start(self, world_size: int) -> None:
        """Make the ranks' group for agreeing on a signal (every rank, after the process group started)."""
        self._group = dist.new_group(backend="gloo") if world_size > 1 else None

    # --- the handler ---

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._training:
            self.received = self.received or signum
            return
        signal.signal(signum, signal.SIG_DFL)  # nothing to save: end as the signal ends a process
        os.kill(os.getpid(), signum)

    def _install(self, trainer: pl.Trainer) -> None:
        if threading.current_thread() is not threading.main_thread() or sys.platform == "win32":
            return
        # Over Lightning's handlers (registered just before the stage runs; its teardown restores what was there).
        self._signals = (signal.SIGTERM, _requeue_signal(trainer))
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
        """The signal every rank agrees was received (0: none), one batch late; every rank calls it after each
        training batch. Reads no device tensor: the flag is a host integer, reduced on a gloo group."""
        if self._group is None:
            return self.received
        result = 0
        if self._pending is not None:
            self._pending.wait()
            result = int(self._flag.item())  # a CPU tensor: no device sync
        self._flag = torch.tensor([self.received], dtype=torch.int32)
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return result

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        signum = self.agreed()
        if not signum:
            return
        self._pending = None  # (signals keep landing on the flag while the checkpoint is saved)
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
