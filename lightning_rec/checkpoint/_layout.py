"""The checkpoint directory on disk: write somewhere invisible, mark complete, then make it visible.

Layout of ``epoch=3-step=400.ckpt/``::

    .metadata        DCP's index of every tensor chunk (rank 0)
    __<r>_0.distcp   rank r's own shards: its table shards, fused optimizer state, and the replicated tensors
                     DCP assigned it (each replicated tensor is written once)
    meta.pt          Lightning's tensor-free state (loops, callbacks, schedulers, param groups), the plan (rank 0)
    COMPLETE         written last: JSON with the size and SHA-256 of every file above

Every save goes to ``.lightning_rec/epoch=3-step=400.ckpt.partial`` beside it and is renamed into place only after
``COMPLETE`` is written, so a visible checkpoint is always complete; a failed save removes its staging directory, and
a crash mid-save leaves only that hidden one, which the next save to that name, or the next fit's start
(:func:`clear_dead_saves`, under the folder's lock), clears. The staging and set-aside names
live in the hidden ``.lightning_rec/`` folder so that no name Lightning scans for (``hpc_ckpt_*``, ``last*.ckpt``)
ever matches one. Overwriting (``last.ckpt``) moves the old one aside, renames the new one in, then deletes the old
one; deleting renames first, so no half-deleted directory ever looks like a checkpoint.

Reading pins one published checkpoint (:func:`pin`): every file the manifest lists is opened once, through one
handle on the directory, and everything after (sizes, hashes, the tensors) is read through those open files. A
``publish`` that replaces or deletes the directory meanwhile cannot mix two saves into one load: the reader either
holds all of one save's files or fails with :class:`CheckpointReplaced` before anything is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_rec.checkpoint import _confined
from lightning_rec.errors import CheckpointError, CheckpointReplacedError

META_FILE = "meta.pt"
COMPLETE_FILE = "COMPLETE"
METADATA_FILE = ".metadata"
FORMAT = "lightning_rec.checkpoint/1"
MODEL_PREFIX = "model/"  # DCP keys of the model state_dict
OPTIM_PREFIX = "optim/"  # DCP keys of optimizer state: optim/<i>/<fqn>/<state name>
_CHUNK = 1 << 22


WORK_DIR = ".lightning_rec"  # beside the checkpoints: staging and set-aside directories, matching no scanned pattern


def staging_path(path: Path) -> Path:
    """Where a save to ``path`` is written before it is complete."""
    return _aside_path(path, "partial")


def _aside_path(path: Path, what: str) -> Path:
    return path.parent / WORK_DIR / f"{path.name}.{what}"


def _tidy(path: Path) -> None:
    """Remove ``path``'s work folder if nothing is left in it."""
    with contextlib.suppress(OSError):
        (path.parent / WORK_DIR).rmdir()


def file_digest(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of one file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def own_files(directory: Path, rank: int) -> list[Path]:
    """The DCP data files rank ``rank`` wrote (``__<rank>_*.distcp``)."""
    return sorted(directory.glob(f"__{rank}_*.distcp"))


def fsync_dir(directory: Path) -> None:
    """Flush ``directory``'s entries (a rename or a new file in it) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and flush it to disk."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def mark_complete(directory: Path, files: dict[str, dict[str, Any]], info: dict[str, Any]) -> None:
    """Write ``COMPLETE`` (the manifest of ``files`` and ``info``) into ``directory``, last."""
    manifest = {"format": FORMAT, **info, "files": dict(sorted(files.items()))}
    write_file(directory / COMPLETE_FILE, json.dumps(manifest, indent=1).encode())
    fsync_dir(directory)


def read_manifest(path: Path) -> dict[str, Any]:
    """The ``COMPLETE`` manifest of the checkpoint at ``path``.

    Raises:
        CheckpointError: ``path`` is not a complete checkpoint directory (says what is missing).
    """
    _check_directory(path)
    try:  # a plain file in the folder, read to its size: never a link out, a FIFO or /dev/zero
        raw = _confined.read_entry(path, COMPLETE_FILE)
    except FileNotFoundError:
        raise _incomplete(path) from None
    return _parse_manifest(raw, path / COMPLETE_FILE)


def _check_directory(path: Path) -> None:
    # One stat, not exists() then is_dir(): a publish renaming `path` away between the two made a directory look
    # like a file to a concurrent reader.
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise _missing(path) from None
    if not stat.S_ISDIR(mode):
        raise _not_a_directory(path)


def _missing(path: Path) -> CheckpointError:
    return CheckpointError(f"Checkpoint {str(path)!r} does not exist.")


def _not_a_directory(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{str(path)!r} is a file; checkpoints of the recshard strategy are directories (torch.distributed."
        "checkpoint). HINT: a single-file state dict comes from `lightning-rec export`; to load it, build the "
        "plain model and call `load_state_dict`."
    )


def _incomplete(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{str(path)!r} is not a complete checkpoint: it has no {COMPLETE_FILE} marker (written last by every "
        "save), so the save that made it did not finish. Use an earlier checkpoint."
    )


def _parse_manifest(raw: bytes, complete: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(raw)
    except ValueError as err:
        raise CheckpointError(f"{complete} is corrupt ({err}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{complete} is not a {FORMAT} manifest.")
    _confined.check_files(manifest.get("files"), complete)  # plain names with sizes: nothing outside the folder
    return manifest


_PROC_FD = Path("/proc/self/fd")  # Linux: a path through an open descriptor reopens the very file it holds


@dataclass
class Pinned:
    """One published checkpoint, its files held open (see :func:`pin`): what is verified is what is loaded.

    Example::

        with pin(Path("last.ckpt")) as ckpt:
            problems = verify_files(ckpt, rank=0, world_size=1)
            metadata = torch.load(ckpt.file("meta.pt"))
    """

    path: Path  # as the caller named it (for messages)
    manifest: dict[str, Any]
    identity: str  # SHA-256 of the COMPLETE manifest: one save, whoever reads it
    fds: dict[str, int] = field(default_factory=dict)

    def file(self, name: str) -> Path:
        """A path that opens the pinned file ``name`` (a file the manifest does not list: by its name)."""
        fd = self.fds.get(name)
        if fd is None or not _PROC_FD.is_dir():
            return self.path / name
        return _PROC_FD / str(fd)

    def close(self) -> None:
        """Let go of the files."""
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


def _moved(path: Path, directory_fd: int) -> bool:
    """Whether ``path`` no longer names the directory open as ``directory_fd`` (replaced, renamed or deleted)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return True
    held = os.fstat(directory_fd)
    return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)


def replaced_error(path: Path) -> CheckpointReplacedError:
    """The error of a read that lost its checkpoint to a newer save."""
    return CheckpointReplacedError(
        f"Checkpoint {str(path)!r} was replaced while reading (a job published a newer one); nothing was read from "
        "it. Reading it again gets the new one."
    )


@contextlib.contextmanager
def pin(path: Path, last_try: bool = True) -> Iterator[Pinned]:
    """Hold the checkpoint published at ``path`` now: its manifest read and every file it lists opened through one
    handle on the directory, so that a ``publish`` or ``remove_tree`` of ``path`` meanwhile changes nothing read.

    ``last_try=False``: where ``path`` is missing and the checkpoint it replaced is aside (a publish between its two
    renames), raise :class:`CheckpointReplacedError` to be tried again; otherwise read the one aside (a crash there).

    Raises:
        CheckpointError: ``path`` is not a complete checkpoint directory.
        CheckpointReplacedError: ``path`` was replaced between opening it and opening its files.
    """
    path, directory = _open_directory(Path(path), last_try)
    pinned: Pinned | None = None
    try:
        try:
            complete = _confined.open_entry(directory, COMPLETE_FILE, path)
        except FileNotFoundError:
            raise (replaced_error(path) if _moved(path, directory) else _incomplete(path)) from None
        try:
            raw = _confined.read_small(complete, COMPLETE_FILE, path)
        finally:
            os.close(complete)
        manifest = _parse_manifest(raw, path / COMPLETE_FILE)
        pinned = Pinned(path, manifest, hashlib.sha256(raw).hexdigest())
        for name in manifest["files"]:
            with contextlib.suppress(FileNotFoundError):  # reported by verify_files
                pinned.fds[name] = _confined.open_entry(directory, name, path)  # refuses names leading out
        if len(pinned.fds) < len(manifest["files"]) and _moved(path, directory):
            raise replaced_error(path)
    except BaseException:
        if pinned is not None:
            pinned.close()
        raise
    finally:
        os.close(directory)
    try:
        yield pinned
    finally:
        pinned.close()


def _open_directory(path: Path, last_try: bool) -> tuple[Path, int]:
    """``path`` (or, on the last try, the checkpoint a crashed publish left aside) opened as a directory.

    Opened first and asked afterwards why that failed: every check before the open is a window in which a
    concurrent publish renames ``path`` away.
    """
    try:
        return path, os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except NotADirectoryError:
        raise _not_a_directory(path) from None
    except FileNotFoundError:
        if not (_aside_path(path, "replaced").exists() or path.exists()):  # now there: published meanwhile
            raise _missing(path) from None
    if not last_try:  # most likely between the two renames of a publish: the new one is a moment away
        raise replaced_error(path)
    aside = recover(path)  # or a crash there left the old one aside
    try:
        return aside, os.open(aside, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        raise replaced_error(path) from None


def _fd_digest(fd: int) -> str:
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, _CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def verify_files(pinned: Pinned, rank: int, world_size: int, hashes: bool = True) -> list[str]:
    """Problems with the pinned checkpoint's files: missing, truncated, or (if ``hashes``) changed.

    Sizes are checked for every file; each rank hashes every ``world_size``-th file, so together the ranks read
    each file once. Both are read from the open files, the ones the load then reads.
    """
    problems = []
    for i, (name, expected) in enumerate(sorted(pinned.manifest["files"].items())):
        fd = pinned.fds.get(name)
        if fd is None:
            problems.append(f"{name}: missing")
            continue
        size = os.fstat(fd).st_size
        if size != expected["size"]:
            problems.append(f"{name}: {size} bytes, expected {expected['size']} (truncated or overwritten)")
        elif hashes and i % world_size == rank and _fd_digest(fd) != expected["sha256"]:
            problems.append(f"{name}: SHA-256 differs from the one recorded at save time (corrupt)")
    return problems


def publish(staging: Path, path: Path) -> None:
    """Make the complete checkpoint in ``staging`` visible as ``path`` (rank 0), replacing any old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.is_file():
        path.unlink()
    if path.is_dir():
        old = _aside_path(path, "replaced")
        remove_tree(old)
        os.rename(path, old)
        os.rename(staging, path)
        remove_tree(old)
    else:
        os.rename(staging, path)
    fsync_dir(path.parent)
    _tidy(path)


def clear_dead_saves(folder: Path) -> list[str]:
    """Tidy what saves that died (Ctrl-C, ``kill -9``, a lost node) left in ``folder``: their staging directories,
    the old staging name (``.hpc_ckpt_2.ckpt.partial``, before the work folder), half-deleted checkpoints; a
    checkpoint left aside by a publish that died between its two renames is put back. Call it only while holding
    the folder's :class:`~lightning_rec.checkpoint._lock.FolderLock` (no live save is in it).

    Returns:
        One line per entry tidied.
    """
    folder = Path(folder)
    done = []
    work = folder / WORK_DIR
    leftovers = sorted(work.iterdir()) if work.is_dir() else []
    for entry in leftovers:
        name, _, what = entry.name.rpartition(".")
        visible = folder / name
        if what == "replaced" and not os.path.lexists(visible) and (entry / COMPLETE_FILE).is_file():
            os.rename(entry, visible)
            done.append(f"{visible}: put back (its replacement's save died before publishing it)")
            continue
        _remove(entry)
        done.append(f"{entry}: removed (left by a save or delete that did not finish)")
    for entry in sorted(folder.glob(".*.ckpt.partial")):
        _remove(entry)
        done.append(f"{entry}: removed (left by a save that did not finish)")
    _tidy(folder / "x")
    return done


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()


def recover(path: Path) -> Path:
    """``path``, or the complete checkpoint a crash between the two renames of :func:`publish` left aside."""
    old = _aside_path(path, "replaced")
    if not path.exists() and (old / COMPLETE_FILE).is_file():
        return old
    return path


def remove_tree(path: Path) -> None:
    """Delete a checkpoint (directory, file or link): renamed aside first, then removed."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir() and path.parent.name == WORK_DIR:  # staging or set aside: never visible as a checkpoint
        shutil.rmtree(path)
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # the work folder, once empty
    elif path.is_dir():
        doomed = _aside_path(path, "deleting")
        doomed.parent.mkdir(exist_ok=True)
        if doomed.exists():
            shutil.rmtree(doomed)
        os.rename(path, doomed)
        shutil.rmtree(doomed)
        _tidy(path)
