"""Where a run's checkpoints are, which of them is its own, and who writes there: ``ckpt_path="last"`` and SLURM's
requeue start across restarts, leftovers that must not stop a start, one writer per folder, and a directory that
cannot be written, found before training rather than at the first save.

``ckpt_path="last"``, as Lightning resolves it, looks in the *new* run's ``version_N/checkpoints`` folder, which a
restarted job (torchrun ``--max-restarts``, a requeue, an operator re-running the command) has just created empty:
the job starts over. :func:`resolve_checkpoint` looks where the run's checkpoints can be: every ``ModelCheckpoint``'s
own folder when it names one, else every ``<logger root>/*/checkpoints`` folder of the run (all its versions), and
the ``default_root_dir`` (the "hpc" checkpoints a preempted job saves). It takes the newest *complete* checkpoint
there *of this run* (the manifest records the run that wrote it: :mod:`~lightning_rec._strategy.run_identity`), and
says which in one line, naming what it skipped: an incomplete or empty entry, a file that is no checkpoint, another
run's checkpoint. With none of this run's, the run starts from scratch, saying so (and naming another run's newest
checkpoint, with how to continue that one instead).

A requeued SLURM job starts with no ``ckpt_path``; Lightning then takes the ``hpc_ckpt_<n>.ckpt`` with the highest
``n`` in ``default_root_dir`` (any name containing ``hpc_ckpt_``, a staging leftover included), and a save that died
there stopped every requeue. :func:`resolve_checkpoint` with ``kind="hpc"`` takes the highest-numbered complete hpc
checkpoint of this run instead, the same way. A complete-marked checkpoint whose files are corrupt is found only by
reading it: the strategy's ``load_checkpoint`` falls back to the next candidate (:attr:`Resolution.fallbacks`).

At fit start rank 0 takes each folder it will write (:func:`hold_folders`: every saving ``ModelCheckpoint``'s
folder): a second job writing one of them is refused in one line; then the staging folders of saves that died there
(and in ``default_root_dir``) are cleared. Any other save (a preempted job's hpc checkpoint in ``default_root_dir``)
locks its folder for the time of the save (:meth:`RunCheckpoints.saving`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_rec._strategy.run_identity import run_identity
from lightning_rec.checkpoint import _layout as layout
from lightning_rec.checkpoint._lock import FolderLock
from lightning_rec.errors import CheckpointError

__all__ = [
    "Resolution",
    "RunCheckpoints",
    "check_writable",
    "checkpoint_folders",
    "hold_folders",
    "resolve_checkpoint",
    "unwritable",
]

_HPC = re.compile(r"^hpc_ckpt_(\d+)\.ckpt$")
_OTHER_RUN = "another run's"
T = TypeVar("T")


def checkpoint_folders(trainer: pl.Trainer) -> list[Path]:
    """The folders a run's checkpoints can be in, across its restarts (see the module docstring)."""
    folders = [Path(trainer.default_root_dir)]
    runs = _version_folders(trainer)
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            folders += [Path(callback.dirpath)] if callback.dirpath is not None else runs
    return list(dict.fromkeys(folders))


def _version_folders(trainer: pl.Trainer) -> list[Path]:
    """Where ``ModelCheckpoint`` without a ``dirpath`` saves, in each of the run's versions."""
    logger = trainer.loggers[0] if trainer.loggers else None
    root = getattr(logger, "root_dir", None) if logger is not None else None
    if root is None:
        return [Path(trainer.default_root_dir) / "checkpoints"]
    return sorted(p for p in Path(root).glob("*/checkpoints") if p.is_dir())


@dataclass
class _Candidate:
    path: Path
    order: tuple[float, int]  # newest first when sorted in reverse
    run: str | None = None
    problem: str | None = None  # why it cannot be resumed from


@dataclass
class Resolution:
    """What ``ckpt_path="last"``/``"hpc"`` resolved to: ``path`` (``None``: start from scratch), and this run's
    other complete checkpoints, newest first, to fall back to if ``path`` turns out corrupt when read."""

    path: Path | None
    fallbacks: list[Path] = field(default_factory=list)


def _inspect(path: Path, hpc_number: int | None) -> _Candidate:
    try:
        mtime = path.stat().st_mtime
    except OSError:
        mtime = 0.0
    try:
        manifest = layout.read_manifest(recovered := layout.recover(path))
        written = (recovered / layout.COMPLETE_FILE).stat().st_mtime
    except (CheckpointError, OSError) as err:
        if path.is_file() or path.is_symlink():
            problem = (
                "empty file, not a checkpoint" if path.is_file() and path.stat().st_size == 0 else "not a checkpoint"
            )
        elif path.is_dir() and not (path / layout.COMPLETE_FILE).exists():
            problem = "incomplete"
        else:
            problem = f"unreadable ({str(err).splitlines()[0]})"
        order = (float(hpc_number), 0) if hpc_number is not None else (mtime, -1)
        return _Candidate(path, order, problem=problem)
    step = int(manifest.get("global_step", -1))
    order = (float(hpc_number), step) if hpc_number is not None else (written, step)
    return _Candidate(path, order, run=manifest.get("run"))


def _candidates(trainer: pl.Trainer, kind: str) -> list[_Candidate]:
    found: list[_Candidate] = []
    if kind == "hpc":
        root = Path(trainer.default_root_dir)
        for entry in sorted(root.iterdir()) if root.is_dir() else []:
            if "hpc_ckpt_" not in entry.name:
                continue
            match = _HPC.match(entry.name)
            if match is None:  # Lightning would read a number from it (and take it for the newest)
                if not entry.name.startswith("."):
                    found.append(_Candidate(entry, (float("inf"), 0), problem="not an hpc checkpoint name"))
                continue
            found.append(_inspect(entry, int(match.group(1))))
    else:
        for folder in checkpoint_folders(trainer):
            names = {p.name for p in folder.glob("*.ckpt")} if folder.is_dir() else set()
            # A publish that died between its two renames left the checkpoint it replaced aside.
            work = folder / layout.WORK_DIR
            names |= {p.name[: -len(".replaced")] for p in work.glob("*.ckpt.replaced")} if work.is_dir() else set()
            found += [_inspect(folder / name, None) for name in sorted(names)]
    return sorted(found, key=lambda c: c.order, reverse=True)


def _describe_run(run: str | None) -> str:
    return f"run {run}" if run is not None else "no run recorded: saved before checkpoints named their run"


def resolve_checkpoint(trainer: pl.Trainer, kind: str, run: str, quiet: bool = False) -> Resolution:
    """``ckpt_path="last"`` (``kind="last"``) or the hpc checkpoint a requeued SLURM job resumes from
    (``kind="hpc"``): the newest complete checkpoint of the run named ``run`` (see the module docstring), said in
    one line unless ``quiet``."""
    candidates = _candidates(trainer, kind)
    own = [c for c in candidates if c.problem is None and c.run == run]
    chosen = own[0] if own else None
    newer = candidates[: candidates.index(chosen)] if chosen is not None else candidates
    skipped = [f"{c.path.name}: {c.problem or _OTHER_RUN}, skipped" for c in newer]
    what = "ckpt_path='last'" if kind == "last" else "SLURM requeue start"
    if chosen is not None:
        if not quiet:
            note = f" ({'; '.join(skipped)})" if skipped else ""
            rank_zero_info(f"{what}: resuming from {chosen.path}, the newest complete checkpoint of this run{note}.")
        return Resolution(chosen.path, [c.path for c in own[1:]])
    if quiet or (kind == "hpc" and not candidates):
        return Resolution(None)
    where = ", ".join(str(f) for f in checkpoint_folders(trainer)) if kind == "last" else trainer.default_root_dir
    other = next((c for c in candidates if c.problem is None), None)
    if other is not None:
        rank_zero_warn(
            f"{what}: no checkpoint of this run (run {run}) in {where}; starting from scratch. The newest one there, "
            f"{other.path}, belongs to another {_describe_run(other.run)}: to continue that one instead, pass its "
            f"path (`ckpt_path=` / `--ckpt_path={other.path}`) or give this run its id ({_how_to_name(other.run)})."
        )
    elif skipped:
        rank_zero_warn(f"{what}: no complete checkpoint in {where} ({'; '.join(skipped)}); starting from scratch.")
    else:
        rank_zero_warn(f"{what}: no checkpoint in {where} yet; starting from scratch.")
    return Resolution(None)


def _how_to_name(run: str | None) -> str:
    if run is not None and run.startswith("user:"):
        return f"LIGHTNING_REC_RUN_ID={run[len('user:') :]}"
    return "LIGHTNING_REC_RUN_ID, or the strategy's `run_id`, on both runs"


def written_folders(trainer: pl.Trainer) -> list[Path]:
    """The folders a fit writes checkpoints into all along: every saving ``ModelCheckpoint``'s. (The
    ``default_root_dir`` gets a checkpoint only when a job is preempted: locked for that save alone, so that jobs
    sharing it, each with its own ``version_N`` folder, can run side by side.)"""
    folders = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            if callback.save_top_k != 0 or callback.save_last:
                folders.append(Path(callback.dirpath))
    return list(dict.fromkeys(p.resolve() for p in folders))


def hold_folders(trainer: pl.Trainer, run: str) -> tuple[list[FolderLock], str | None]:
    """Rank 0's part of a fit's start: lock every folder it writes (:func:`written_folders`), then clear what
    dead saves left there (one line each); the same in ``default_root_dir`` if no live job is saving there. Returns
    the locks, or none and why another job holds a folder."""
    locks: list[FolderLock] = []
    root = Path(trainer.default_root_dir).resolve()
    for folder in written_folders(trainer):
        if os.path.lexists(folder) and not folder.is_dir():
            continue  # `unwritable` names it
        try:
            locks.append(FolderLock.acquire(folder, run))
        except CheckpointError as err:
            for lock in locks:
                lock.release()
            return [], str(err)
        except OSError:
            continue  # a folder this job cannot write: `unwritable` names it, where it matters
        _clear_dead_saves(folder)
    # Where a restart finds the run's checkpoints (its earlier version_N folders, default_root_dir) but does not
    # write now: tidied under a lock taken for that moment.
    held = {lock.folder for lock in locks}
    for folder in dict.fromkeys(p.resolve() for p in [root, *checkpoint_folders(trainer), *_version_folders(trainer)]):
        if folder in held or not folder.is_dir():
            continue
        try:
            lock = FolderLock.acquire(folder, run)
        except (CheckpointError, OSError):
            continue  # a live job is saving there (or it cannot be written): leave it be
        _clear_dead_saves(folder)
        lock.release()
    return locks, None


def _clear_dead_saves(folder: Path) -> None:
    for line in layout.clear_dead_saves(folder):
        rank_zero_info(f"Checkpoint folder {line}.")


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


class RunCheckpoints:
    """The strategy's side of this module for one run: its name, what "last" resolved to (and the fallbacks), the
    folders its rank 0 holds.

    Example::

        checkpoints = RunCheckpoints(run_id=None)
        path = checkpoints.resolve(trainer, "last")   # before any hook: Lightning's checkpoint connector
        checkpoints.hold(trainer, rank=0, all_gather=strategy._all_gather_objects)   # fit start
        meta = checkpoints.load_first_intact(path, lambda p: load(p, ...))
        checkpoints.release()   # teardown
    """

    def __init__(self, run_id: str | None) -> None:
        self.run_id = run_id
        self._fallbacks: dict[str, list[str]] = {}
        self._locks: list[FolderLock] = []
        self._held: set[Path] = set()  # the folders rank 0 holds for the fit, known on every rank

    def run(self, trainer: pl.Trainer) -> str:
        """The name of the run ``trainer`` fits (:func:`~lightning_rec._strategy.run_identity.run_identity`)."""
        datamodule = getattr(trainer, "datamodule", None)  # set by Lightning's data connector
        return run_identity(trainer.lightning_module, datamodule, explicit=self.run_id)

    def resolve(self, trainer: pl.Trainer, kind: str, quiet: bool = False) -> str | None:
        """:func:`resolve_checkpoint` for this run; remembers the fallbacks for :meth:`load_first_intact`."""
        found = resolve_checkpoint(trainer, kind, self.run(trainer), quiet=quiet)
        if found.path is None:
            return None
        self._fallbacks[str(found.path)] = [str(p) for p in found.fallbacks]
        return str(found.path)

    def fallbacks(self, path: str) -> list[str]:
        """This run's older complete checkpoints to try if ``path`` (what :meth:`resolve` returned) is corrupt."""
        return self._fallbacks.get(path, [])

    def load_first_intact(self, candidates: list[str], load_one: Callable[[Path], T]) -> T:
        """``load_one`` of the first of ``candidates`` that loads (every rank; each failure, raised on every rank
        before anything was modified, said in one line); all failing: the first one's error."""
        first: CheckpointError | None = None
        for i, candidate in enumerate(candidates):
            try:
                return load_one(Path(candidate))
            except CheckpointError as err:
                first = first or err
                if i + 1 == len(candidates):
                    raise first from None
                reason = str(err).splitlines()[-1].strip(" -")
                rank_zero_warn(f"{candidate}: cannot be resumed from ({reason}); trying {candidates[i + 1]}.")
        raise AssertionError("no candidates")

    def hold(self, trainer: pl.Trainer, rank: int, all_gather: Callable[[Any], list[Any]]) -> None:
        """Fit start, every rank: rank 0 takes the folders this fit writes (:func:`hold_folders`); if another job
        holds one, every rank raises the same one-line :class:`CheckpointError`."""
        problem = None
        if rank == 0:
            self.release()
            self._locks, problem = hold_folders(trainer, self.run(trainer))
        problem, held = all_gather((problem, [lock.folder for lock in self._locks]))[0]
        if problem is not None:
            raise CheckpointError(problem)
        self._held = set(held)

    @contextlib.contextmanager
    def saving(self, path: Path, run: str | None, rank: int, all_gather: Callable[[Any], list[Any]]) -> Iterator[None]:
        """Around one save into ``path``'s folder (every rank): a folder this fit does not hold already (the hpc
        checkpoint of a preempted job, ``trainer.save_checkpoint`` anywhere) is locked by rank 0 for the save; held
        by another job, the save is refused on every rank (its earlier checkpoints stay as they are)."""
        folder = Path(path).parent.resolve()
        if folder in self._held:
            yield
            return
        lock, problem = None, None
        if rank == 0:
            try:
                lock = FolderLock.acquire(folder, run or "unnamed")
            except CheckpointError as err:
                problem = str(err).replace("nothing was trained", f"{Path(path).name} was not saved")
            except OSError:
                pass  # cannot be written: the save says so, naming the cause
        problem = all_gather(problem)[0]
        if problem is not None:
            raise CheckpointError(problem)
        try:
            yield
        finally:
            if lock is not None:
                lock.release()

    def release(self) -> None:
        """Let go of the folders (fit end, or the process's end, whichever comes first)."""
        for lock in self._locks:
            lock.release()
        self._locks, self._held = [], set()
