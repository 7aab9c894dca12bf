"""Where a run's checkpoints are: ``ckpt_path="last"`` across restarts, and a directory that cannot be written,
found before training rather than at the first save.

``ckpt_path="last"``, as Lightning resolves it, looks in the *new* run's ``version_N/checkpoints`` folder, which a
restarted job (torchrun ``--max-restarts``, a requeue, an operator re-running the command) has just created empty:
the job starts over. :func:`resolve_last_checkpoint` looks where the run's checkpoints can be: every
``ModelCheckpoint``'s own folder when it names one, else every ``<logger root>/*/checkpoints`` folder of the run (all
its versions), and the ``default_root_dir`` (the "hpc" checkpoints a preempted job saves); it takes the newest
*complete* checkpoint there (so a ``last.ckpt`` whose save failed falls back to the one before) and says which, in
one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_rec.checkpoint._io import latest
from lightning_rec.errors import CheckpointError

__all__ = ["check_writable", "checkpoint_folders", "resolve_last_checkpoint", "unwritable"]


def checkpoint_folders(trainer: pl.Trainer) -> list[Path]:
    """The folders a run's checkpoints can be in, across its restarts (see the module docstring)."""
    folders = [Path(trainer.default_root_dir)]
    runs: list[Path] = []
    logger = trainer.loggers[0] if trainer.loggers else None
    root = getattr(logger, "root_dir", None) if logger is not None else None
    if root is not None:
        runs = sorted(p for p in Path(root).glob("*/checkpoints") if p.is_dir())
    else:
        runs = [Path(trainer.default_root_dir) / "checkpoints"]
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            folders += [Path(callback.dirpath)] if callback.dirpath is not None else runs
    return list(dict.fromkeys(folders))


def resolve_last_checkpoint(trainer: pl.Trainer) -> str | None:
    """``ckpt_path="last"``: the newest complete checkpoint of the run (``None``: none, Lightning's own warning)."""
    found, skipped = latest(checkpoint_folders(trainer))
    if found is None:
        return None
    since = found.stat().st_mtime
    newer = [p for p in skipped if p.exists() and p.stat().st_mtime > since]
    fallback = f" ({', '.join(p.name for p in newer)}: incomplete, skipped)" if newer else ""
    rank_zero_info(f"ckpt_path='last': resuming from {found}, the newest complete checkpoint of this run{fallback}.")
    return str(found)


def unwritable(trainer: pl.Trainer) -> list[str]:
    """The checkpoint folders this process cannot write (read-only, another user's, a file in the way), each with
    why: what the strategy refuses before training rather than at the first save, an epoch later."""
    problems = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
            continue
        if callback.save_top_k == 0 and not callback.save_last:
            continue
        folder = Path(callback.dirpath)
        existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            problems.append(f"{folder}: {existing} is a file")
        elif existing is not None and not os.access(existing, os.W_OK | os.X_OK):
            problems.append(f"{folder}: {existing} is not writable (a read-only file system, or permissions)")
    return problems


def check_writable(problems: list[str]) -> None:
    """Raise the error for :func:`unwritable`'s ``problems`` (all ranks'), if any."""
    if problems:
        raise CheckpointError(
            "ModelCheckpoint cannot save its checkpoints:\n  - "
            + "\n  - ".join(problems)
            + "\nChecked at fit start: nothing was trained. HINT: give `ModelCheckpoint(dirpath=...)` (or the "
            "Trainer's `default_root_dir`) a directory this job can write."
        )
