"""Fault injection: a rank that raises, is killed, hangs or gets a bad batch mid-fit, and when it did."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L

__all__ = ["FailAt", "failure_time"]


class FailAt(L.Callback):
    """On rank ``rank``, at the start of training step ``step``, fail in the way ``how`` says.

    Just before failing, the rank writes the time (``time.time()``) to ``out_dir/failed.rank<R>``, which
    :func:`failure_time` reads back: the other ranks' reaction can be timed from it.

    Args:
        rank: the global rank that fails.
        step: the ``global_step`` at which it fails.
        how: ``"raise"`` (a RuntimeError), ``"kill"`` (SIGKILL itself), ``"hang"`` (SIGSTOP itself: alive, silent)
            or ``"bad_id"`` (its batch gets an id far outside its table).
        out_dir: where ``failed.rank<R>`` records the time of the failure.
        once: fail only if ``failed.rank<R>`` is not there yet, i.e. not again in a restarted job.

    Example::

        trainer = L.Trainer(strategy="recshard", callbacks=[FailAt(rank=1, step=6, how="kill", out_dir=out)])
    """

    def __init__(self, rank: int, step: int, how: str, out_dir: str | Path, once: bool = False) -> None:
        self.rank, self.step, self.how, self.out_dir, self.once = rank, step, how, Path(out_dir), once

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if self.once and (self.out_dir / f"failed.rank{self.rank}").exists():
            return
        (self.out_dir / f"failed.rank{self.rank}").write_text(repr(time.time()))
        if self.how == "raise":
            raise RuntimeError(f"injected failure on rank {self.rank}")
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.how == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.how == "bad_id":
            batch.sparse_features.values()[0] = 10**6  # in place: the strategy checks it at the table's door


def failure_time(out_dir: str | Path, rank: int) -> float:
    """When :class:`FailAt` made ``rank`` fail.

    Args:
        out_dir: the ``out_dir`` given to :class:`FailAt`.
        rank: the rank that failed.

    Returns:
        The ``time.time()`` the failing rank recorded just before it failed.
    """
    return float((Path(out_dir) / f"failed.rank{rank}").read_text())
