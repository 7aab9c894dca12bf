"""A checkpoint's entries, opened without leaving its folder.

A checkpoint's manifest (``COMPLETE``) and DCP's ``.metadata`` name the files a load reads. Both come from
whoever wrote the folder, so a name is only followed if it is a plain file name in the folder (``meta.pt``,
``__0_0.distcp``: never ``../x``, ``/dev/zero`` or ``data/x``), and only to a regular file that lies in the folder
(a symbolic link to a file beside it is fine, one that leads out is not; a FIFO or device is never opened for
reading, so nothing can block or stream without end). Every refusal names the entry.

Example::

    folder = os.open("last.ckpt", os.O_RDONLY | os.O_DIRECTORY)
    fd = open_entry(folder, "meta.pt", Path("last.ckpt"))      # a regular file inside last.ckpt, or an error
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

from lightning_rec.errors import CheckpointError

MAX_MANIFEST_BYTES = 1 << 30  # ~100 bytes per file listed: a million files is 100 MB; a larger one is crafted

_PROC_FD = Path("/proc/self/fd")  # Linux: the path of the file an open descriptor holds


def check_name(name: Any, folder: Path, what: str = "manifest entry") -> None:
    """Raise unless ``name`` is a plain file name inside ``folder`` (what this package writes: no directories).

    Raises:
        CheckpointError: naming the entry and saying why it is not followed.
    """
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "/" in name
        or (os.altsep is not None and os.altsep in name)
        or os.sep in name
        or "\0" in name
    ):
        raise CheckpointError(
            f"{str(folder)!r}: the {what} {name!r} is not a file name inside the checkpoint folder (a checkpoint "
            "lists only its own files, by name); refusing to read it. The checkpoint was altered or crafted."
        )


def _real(path: str | Path) -> str:
    return os.path.realpath(path)


def _folder_of(directory: int, folder: Path) -> str:
    """The real path of the folder open as ``directory``."""
    held = _PROC_FD / str(directory)
    return os.readlink(held) if held.is_symlink() else _real(folder)


def _inside(target: str, root: str) -> bool:
    return os.path.dirname(target) == root or target.startswith(root.rstrip(os.sep) + os.sep)


def open_entry(directory: int, name: str, folder: Path, what: str = "manifest entry") -> int:
    """The file ``name`` of the folder open as ``directory`` (``folder``: its path, for messages), opened read-only.

    Raises:
        FileNotFoundError: there is no such entry (the caller says what that means).
        CheckpointError: ``name`` is not a plain file name, or leads (through a symbolic link) out of the folder, or
            is not a regular file (a FIFO, a device, a directory).
    """
    check_name(name, folder, what)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # O_NONBLOCK: a FIFO's open does not wait
    target: str | None = None
    if stat.S_ISLNK(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode):
        # Resolved before anything is opened: opening a device or FIFO outside can itself block or act.
        through = _PROC_FD / str(directory) / name if _PROC_FD.is_dir() else folder / name
        target = _real(through)
        if not _inside(target, _folder_of(directory, folder)):
            raise _outside(folder, name, what, target)
    else:
        flags |= os.O_NOFOLLOW  # a plain name in the open folder: inside it, unless it became a link since
    try:
        fd = os.open(name, flags, dir_fd=directory)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _outside(folder, name, what, "elsewhere (it became a link while opened)") from None
        raise
    try:
        held = os.fstat(fd)
        if not stat.S_ISREG(held.st_mode):
            raise CheckpointError(
                f"{str(folder)!r}: the {what} {name!r} is not a regular file ({_kind(held.st_mode)}); refusing to "
                "read it. The checkpoint was altered or crafted."
            )
        if target is not None:  # the link resolved inside: the file opened must be that one (not a swapped link's)
            now = os.stat(target)
            if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
                raise _outside(folder, name, what, "elsewhere (it changed while opened)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _outside(folder: Path, name: str, what: str, target: str) -> CheckpointError:
    return CheckpointError(
        f"{str(folder)!r}: the {what} {name!r} is a symbolic link to {target!r}, outside the checkpoint folder; "
        "refusing to read it. HINT: copy the file into the folder (`cp -L`) if you made that link yourself."
    )


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a plain file"


def read_small(fd: int, name: str, folder: Path, limit: int = MAX_MANIFEST_BYTES) -> bytes:
    """All of the regular file open as ``fd`` (at most ``limit`` bytes: a larger one is refused, not read)."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise CheckpointError(
            f"{str(folder)!r}: {name} is {size} bytes, more than the {limit} bytes any checkpoint's {name} takes; "
            "refusing to read it."
        )
    chunks, offset = [], 0
    while offset < size and (chunk := os.pread(fd, size - offset, offset)):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def read_entry(folder: Path, name: str, what: str = "manifest entry", limit: int = MAX_MANIFEST_BYTES) -> bytes:
    """The small file ``name`` of ``folder`` (see :func:`open_entry`, :func:`read_small`).

    Raises:
        FileNotFoundError: ``folder`` or its ``name`` does not exist.
        CheckpointError: as :func:`open_entry`, or the file is larger than a manifest can be.
    """
    directory = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = open_entry(directory, name, folder, what)
    finally:
        os.close(directory)
    try:
        return read_small(fd, name, folder, limit)
    finally:
        os.close(fd)


def check_files(files: Any, complete: Path) -> None:
    """Raise unless the manifest's ``files`` maps plain file names to ``{"size": bytes, "sha256": hex}``.

    Raises:
        CheckpointError: naming the first entry that is not that.
    """
    if not isinstance(files, dict):
        raise CheckpointError(f"{complete}: 'files' is a {type(files).__name__}, not a mapping of file names.")
    for name, record in files.items():
        check_name(name, complete.parent)
        size = record.get("size") if isinstance(record, dict) else None
        if not (
            isinstance(size, int) and not isinstance(size, bool) and size >= 0 and isinstance(record.get("sha256"), str)
        ):
            raise CheckpointError(
                f"{complete}: the entry {name!r} records {record!r}, not a size in bytes and a SHA-256; refusing to "
                "read the checkpoint."
            )
