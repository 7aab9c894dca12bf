"""The process's fork server, started once with this package imported and one OpenMP thread: what DataLoader workers
(:func:`worker_context`) and test ranks (:mod:`lightning_rec.testing.launch`) are forked from; and
:func:`worker_start_method`, the one place that decides when a worker starts otherwise, and why.

A child forked from it skips the ~4 s of CPU a new interpreter spends importing torch, TorchRec, FBGEMM and
Lightning, and is not forked from the training process, whose gloo threads could hold a lock at the fork. The server
itself runs with ``OMP_NUM_THREADS=1``: had an import run an OpenMP parallel region with a team of threads there, a
child using more than one intra-op thread would wait forever on threads that were not forked with it. (Python keeps
one fork server per process; whichever of the two users starts it, it is this one.)

A rank's helpers (the fork server, its DataLoader workers, multiprocessing's resource tracker) leave signals to the
rank and die with it:

* **Signals reach only who acts on them.** A scheduler signals every process of a job (SLURM's ``scancel`` and
  ``--signal`` without ``B:``, a terminal's Ctrl-C to its process group): had a worker died of SLURM's ``SIGUSR1``,
  the rank would have failed with "DataLoader worker exited unexpectedly" instead of saving and requeueing. The fork
  server and the resource tracker start with :data:`RANK_SIGNALS` blocked (a blocked mask is kept through fork and
  exec, and can be set from any thread), and each worker ignores and blocks them (:func:`serve_the_rank_only`).
* **No orphans.** Multiprocessing hands every child of a fork server the write end of the server's "alive" pipe (so
  that a child could use the server too): the workers kept the server alive, and the server (their parent, which
  PyTorch's worker watchdog looks at) kept them alive, after their rank was killed: ~370 MB per rank, for good. A
  worker closes that end and is killed when its parent dies (Linux's parent-death signal, :func:`die_with_parent`),
  as is the server when the rank dies (:mod:`lightning_rec._forkserver_start`; else it would end only once the rank's
  end of the pipe closed, after its interpreter's slow exit: 9 s at a load of 14 on 2 cores here), and the resource
  tracker ends with the last of them.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import inspect
import io
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch

from lightning_rec import _compat
from lightning_rec._compat.python import forget_fork_server

__all__ = [
    "PARENT_VARIABLE",
    "RANK_SIGNALS",
    "die_with_parent",
    "forkserver_context",
    "serve_the_rank_only",
    "worker_context",
    "worker_start_method",
]

# What a scheduler or a terminal sends a whole job: the rank's to act on (a checkpoint, an exit code), no helper's.
RANK_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

PRELOAD = ["lightning_rec._forkserver_start", "lightning_rec", "lightning_rec.data.tabular"]
# The pid of the process starting the fork server, in the server's environment only when the starting thread is that
# process's main thread (the one whose end is the process's end): lightning_rec._forkserver_start reads it.
PARENT_VARIABLE = "LIGHTNING_REC_FORKSERVER_PARENT"
_START = threading.Lock()
# The pid of the process that started the server, once it has. A process forked from that one (a notebook launcher's
# rank) inherits this list and multiprocessing's handle on the server, but cannot use the handle.
_started: list[int] = []
_log = logging.getLogger(__name__)


def forkserver_context() -> Any:
    """Multiprocessing's ``forkserver`` context, its server started (once) as the module says; ``None`` where the
    platform has no fork server, or where this process cannot use one: the server was started by a process this one
    was forked from (multiprocessing keeps one per process, and reaches it only from the process that started it:
    elsewhere ``ChildProcessError``)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    with _START:
        if _started:
            return context if _started[0] == os.getpid() else None
        context.set_forkserver_preload(PRELOAD)  # ignored once the server runs
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # the server's environment is this process's when it starts
        if threading.current_thread() is threading.main_thread():
            os.environ[PARENT_VARIABLE] = str(os.getpid())
        try:
            with _deaf_helpers():
                _resource_tracker()  # the server's own start would start it, then unblock SIGINT/SIGTERM here
                forkserver.ensure_running()
        except ChildProcessError:
            return None  # started (by multiprocessing, for anyone) in a process this one was forked from
        finally:
            os.environ.pop(PARENT_VARIABLE, None)
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _started.append(os.getpid())  # later calls (a loader per pass, a launch per test) leave the environment alone
    return context


@contextlib.contextmanager
def _deaf_helpers() -> Iterator[None]:
    """:data:`RANK_SIGNALS` blocked in this thread while a helper process is spawned: the helper inherits the mask
    (through fork and exec; Python leaves a blocked signal alone), so a signal sent to the whole job stays pending
    there, never acted on. Unlike ``signal.signal``, this works from any thread (a loader started in one)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, RANK_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _resource_tracker() -> None:
    """Start multiprocessing's resource tracker (once per process) as a helper that leaves signals to the rank
    (:func:`_deaf_helpers`). Its own start unblocks SIGINT and SIGTERM in the calling thread afterwards: they are
    blocked again for whatever is spawned next in the same window."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, RANK_SIGNALS)


def serve_the_rank_only() -> None:
    """In a DataLoader worker, as it starts: ignore :data:`RANK_SIGNALS` (the rank acts on them, then ends its
    workers itself), and stop holding its fork server alive (the server's "alive" pipe, which multiprocessing hands
    every child of a fork server: the server then ends with the rank that started it). A worker's death with its
    parent is :func:`die_with_parent`'s.

    The signals are also kept blocked, in this thread and so in every thread it starts: PyTorch's worker loop
    installs a SIGTERM handler of its own after this runs (in C: it ends the worker unless the signal came from its
    parent), and a blocked signal never reaches a handler."""
    for signum in RANK_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)  # a pending one (blocked in the fork server) is discarded
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, RANK_SIGNALS)
    forget_fork_server()  # (a dataset that starts processes of its own starts its own server)


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when the thread that forked it ends (``PR_SET_PDEATHSIG``): a worker has
    nothing to save, and a worker whose rank was killed (``kill -9``, the OOM killer) must not live on. ``parent``:
    this process's parent as it started; gone already (the race before the request), the worker ends now."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return
    if os.getppid() != parent:
        os._exit(1)


def worker_context() -> Any:
    """The ``multiprocessing_context`` of the package's DataLoaders: each worker starts as
    :func:`worker_start_method` decides, from the fork server where it can; ``None`` (PyTorch's own choice) where the
    platform has no fork server."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    return _WorkerContext()


def worker_start_method(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """How a DataLoader worker that runs ``target(*args, **kwargs)`` starts: ``"forkserver"``, or ``None``, the start
    method PyTorch uses for a loader without a context (multiprocessing's default: fork on Linux). The one place
    this is decided, when the worker starts (not when its loader is built: a loader built in a notebook's kernel
    starts its workers in the ranks forked from it).

    From the fork server (:func:`forkserver_context`), unless it cannot serve the worker; then as PyTorch would, for
    these reasons, checked in this order:

    1. ``__main__``'s top-level code, outside ``if __name__ == "__main__":``, is starting the workers: a child of the
       fork server runs ``__main__`` again to rebuild it, and would start them again (multiprocessing's "bootstrapping
       phase" error). A fork copies ``__main__`` instead.
    2. The worker's dataset, sampler or functions cannot be pickled (a lambda, a lock, an open file): a child of the
       fork server receives them pickled, a fork inherits them.
    3. They hold a class or function defined in a ``__main__`` that a new process cannot rebuild, one without a file:
       a notebook's cell, ``python - < script.py``, ``python -c``, an interactive session. The child could not
       unpickle them; a fork has them.
    4. This process cannot use a fork server: the server was started by a process this one was forked from (a
       notebook launcher's rank, after the kernel started it), or the platform has none.

    Example::

        >>> worker_start_method(print, (lambda batch: batch,), {})   # a lambda cannot be pickled: as PyTorch would
    """
    reason = _why_not_forkserver(target, args, kwargs)
    if reason is None:
        return "forkserver"
    _log.debug("DataLoader worker started as PyTorch would, not from the fork server: %s", reason)
    return None


class _WorkerProcess(_compat.ForkServerProcess):
    start_method = staticmethod(worker_start_method)

    def start(self) -> None:
        # A worker forked from this process (as PyTorch would, not from the fork server) has this thread for parent
        # in Linux's sense: a parent-death signal would kill it when the thread ends (a loader iterated in a thread
        # of its own), not when the rank does; PyTorch's own watchdog (its parent's pid, every 5 s) covers that case.
        self._started_in_main_thread = threading.current_thread() is threading.main_thread()
        super().start()

    def run(self) -> None:
        parent = os.getppid()
        serve_the_rank_only()
        # From the fork server (its main thread forks, and lives as long as the rank) or from a rank's main thread.
        if parent != self._parent_pid or getattr(self, "_started_in_main_thread", False):  # type: ignore[attr-defined]
            die_with_parent(parent)
        super().run()


class _WorkerContext(_compat.ForkServerContext):
    Process = _WorkerProcess

    # The first objects a DataLoader makes from its context, before any worker starts; the first semaphore starts
    # multiprocessing's resource tracker, which is to leave signals to the rank as the fork server does.
    def Queue(self, maxsize: int = 0) -> Any:  # noqa: N802 - multiprocessing's name
        _quiet_resource_tracker()
        return super().Queue(maxsize)

    def Event(self) -> Any:  # noqa: N802 - multiprocessing's name
        _quiet_resource_tracker()
        return super().Event()


def _quiet_resource_tracker() -> None:
    with _deaf_helpers():
        _resource_tracker()


def _why_not_forkserver(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    main = sys.modules.get("__main__")
    if _main_rebuilt_in_child(main) and _main_code_unguarded(main):
        return "__main__'s top-level code starts the workers outside `if __name__ == '__main__':`"
    finder = _MainFinder(record_main=not _main_rebuilt_in_child(main))
    try:
        finder.dump((target, args, kwargs))
    except _DefinedInMain as found:
        return f"{found.args[0]} is defined in a __main__ that a new process cannot rebuild (no file)"
    except Exception as error:  # whatever pickle raises: the fork server's child could not be given it
        return f"the worker's arguments cannot be pickled ({type(error).__name__}: {error})"
    if forkserver_context() is None:
        return "this process cannot use a fork server (started by a process this one was forked from)"
    return None


def _main_rebuilt_in_child(main: Any) -> bool:
    # What multiprocessing's spawn.get_preparation_data tells a child: import __main__ by its module name (`python -m`;
    # a package's __main__ is skipped), or run its file; else nothing, and __main__'s names are missing there.
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return not (spec.name == "__main__" or spec.name.endswith(".__main__"))
    path = getattr(main, "__file__", None)
    return path is not None and os.path.exists(path)


def _main_code_unguarded(main: Any) -> bool:
    """Whether ``__main__``'s module-level code is on the stack at a line outside ``if __name__ == "__main__":``."""
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:
        return False
    line = frame.f_lineno
    try:
        tree = ast.parse(inspect.getsource(main))
    except (OSError, TypeError, SyntaxError):
        return True  # unreadable: as if unguarded (a fork is what PyTorch would do anyway)
    for statement in tree.body:
        if statement.lineno <= line <= (statement.end_lineno or statement.lineno):
            return not (isinstance(statement, ast.If) and "__name__" in ast.unparse(statement.test))
    return True


class _DefinedInMain(Exception):
    pass


class _MainFinder(pickle.Pickler):
    """Pickles to nowhere, as a fork server's child would be sent it, to learn whether it can be; tensors, arrays and
    multiprocessing's own objects (queues, events: pickled through their own channel) are not walked into, nor are
    large buffers copied. With ``record_main``, raises :class:`_DefinedInMain` at the first class or function
    defined in ``__main__``."""

    def __init__(self, record_main: bool) -> None:
        super().__init__(_Nowhere(), protocol=5, buffer_callback=lambda buffer: False)
        self.record_main = record_main

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) or torch.is_storage(obj):
            return 0
        if type(obj).__module__.partition(".")[0] in ("numpy", "multiprocessing"):
            return 0
        owner = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
        if self.record_main and getattr(owner, "__module__", None) == "__main__":
            raise _DefinedInMain(f"{getattr(owner, '__qualname__', owner)!s}")
        return None


class _Nowhere(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return len(b)
