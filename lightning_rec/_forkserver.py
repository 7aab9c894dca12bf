"""The process's fork server, started once with this package imported and one OpenMP thread: what stream workers
(:mod:`lightning_rec.data.stream`) and test ranks (:mod:`lightning_rec.testing.launch`) are forked from.

A child forked from it skips the ~4 s of CPU a new interpreter spends importing torch, TorchRec, FBGEMM and
Lightning. The server itself runs with ``OMP_NUM_THREADS=1``: had an import run an OpenMP parallel region with a
team of threads there, a child using more than one intra-op thread would wait forever on threads that were not
forked with it. (Python keeps one fork server per process; whichever of the two users starts it, it is this one.)
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any

from lightning_rec import _compat

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
    return _compat.ForkServerContext() if forkserver_context() is not None else "spawn"
