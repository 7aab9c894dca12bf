"""One writer per checkpoint folder: a lock a job's rank 0 holds on each folder it saves into, for the whole fit.

Two jobs saving into one folder write the same staging directories (``.lightning_rec/last.ckpt.partial``) and
replace each other's checkpoints: one crashes, and a ``last.ckpt`` mixing both jobs' files can be published. So
the second job is refused at its start, in one line naming the job holding the folder.

The lock is ``flock`` on the folder itself (its directory file descriptor): nothing is written into the user's folder,
and the kernel drops the lock when its process ends however it ends (``kill -9`` included), so a dead job holds
nothing and a restarted job takes the folder over at once. The refusal names the holder's process id, read from
``/proc/locks``. Where a file system refuses a directory's lock (NFS emulates ``flock`` with POSIX locks, which need a
file open for writing), the lock is taken on ``<folder>/.lightning_rec-writer.lock`` instead, which says who holds it
(host, pid, run); ``flock`` must then reach the server (NFSv4 does; Lustre needs the ``flock`` mount option).

Example::

    lock = FolderLock.acquire(Path("runs/x/checkpoints"), "config:1f2e3d4c5b6a")
    ...  # saves
    lock.release()
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from lightning_rec.errors import CheckpointError

LOCK_FILE = ".lightning_rec-writer.lock"


@dataclass
class FolderLock:
    """The lock on one checkpoint folder, held through an open file (see the module docstring)."""

    folder: Path
    fd: int
    file: bool = False  # held through LOCK_FILE (a file system without directory locks)

    @classmethod
    def acquire(cls, folder: Path, run: str) -> FolderLock:
        """Take ``folder`` for this process (created if missing).

        Raises:
            CheckpointError: another live job holds it (the message names that job and the folder).
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _directory_holder(fd)
            os.close(fd)
            raise _in_use(folder, holder) from None
        except OSError:  # a file system without directory locks (NFS): the lock file
            os.close(fd)
            return cls(folder, _acquire_file(folder, run), file=True)
        return cls(folder, fd)

    def release(self) -> None:
        """Let go of the folder (a lock file is removed while still held, so that no one locks a stale one)."""
        if self.fd < 0:
            return
        if self.file:
            with contextlib.suppress(OSError):
                os.unlink(self.folder / LOCK_FILE)
        os.close(self.fd)
        self.fd = -1


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"host {holder['host']}, pid {holder['pid']}, run {holder['run']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a job that has not said who it is yet"


def _in_use(folder: Path, holder: str) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint folder {str(folder)!r} is in use by another job ({holder}): two jobs saving into "
        "one folder overwrite each other's checkpoints; nothing was trained. HINT: give this job its own "
        "`default_root_dir` (or `ModelCheckpoint(dirpath=...)`), or stop the other job first."
    )


def _acquire_file(folder: Path, run: str) -> int:
    """The lock on ``folder/LOCK_FILE`` (see the module docstring): its open descriptor."""
    path = folder / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise _in_use(folder, holder) from None
        # The holder before us may have deleted the file (release) between our open and our flock: then we
        # hold a lock on a file nobody else will open. Lock the file that is there now instead.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "run": run}).encode(), 0)
    return fd


def _directory_holder(fd: int) -> str:
    """Who holds the ``flock`` on the directory open as ``fd``: ``/proc/locks`` lists each lock's process and the
    file's ``major:minor:inode`` (device numbers in hex)."""
    info = os.fstat(fd)
    where = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        with open("/proc/locks") as locks:
            for line in locks:
                fields = line.split()
                if "->" not in fields and len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == where:
                    return f"host {socket.gethostname()}, pid {fields[4]}"
    except OSError:
        pass
    return "a process of this host"
