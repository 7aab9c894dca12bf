"""The process's fork server, started once with this package imported and one OpenMP thread: what stream workers
(:mod:`lightning_rec.data.stream`) and test ranks (:mod:`lightning_rec.testing.launch`) are forked from.

A child forked from it skips the ~4 s of CPU a new interpreter spends importing torch, TorchRec, FBGEMM and
Lightning. The server itself runs with ``OMP_NUM_THREADS=1``: had an import run an OpenMP parallel region with a
team of threads there, a child using more than one intra-op thread would wait forever on threads that were not
forked with it. (Python keeps one fork server per process; whichever of the two users starts it, it is this one.)
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["forkserver_context", "worker_context"]

PRELOAD = ["lightning_rec", "lightning_rec.data.tabular"]
_START = threading.Lock()
_started: list[bool] = []  # the server was started by this process (multiprocessing restarts one that died)


def forkserver_context() -> Any:
    """Multiprocessing's ``forkserver`` context, its server started (once) as the module says; ``None`` where the
    platform has no fork server."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    with _START:
        if _started:
            return context
        context.set_forkserver_preload(PRELOAD)  # ignored once the server runs
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # the server's environment is this process's when it starts
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _started.append(True)  # later calls (a loader per pass, a launch per test) leave the environment alone
    return context


def worker_context() -> Any:
    """How DataLoader workers start: forked from this fork server, where there is one, else spawned; never forked
    from the training process itself, whose gloo threads could deadlock a fork. Either way a worker runs the
    script's ``__main__`` again, from its file; a script that has none (``python - < script.py``: ``__file__`` is
    ``"<stdin>"``) starts its workers as a notebook's do, without it."""
    context = forkserver_context()
    return _WorkerContext() if context is not None else "spawn"


@contextlib.contextmanager
def _main_without_missing_file() -> Iterator[None]:
    # multiprocessing (spawn and forkserver) re-runs ``__main__`` in the child from ``__main__.__file__``; a script
    # read from standard input names "<stdin>", which the child cannot open (FileNotFoundError, and the DataLoader
    # then reports its workers "exited unexpectedly"). Without ``__file__`` the child skips that step, as it does for
    # an interactive session.
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or getattr(main, "__spec__", None) is not None or os.path.exists(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


class _WorkerProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        with _main_without_missing_file():
            return multiprocessing.context.ForkServerProcess._Popen(process_obj)


class _WorkerContext(multiprocessing.context.ForkServerContext):
    """The fork server's context, its processes started by :class:`_WorkerProcess`."""

    Process = _WorkerProcess
