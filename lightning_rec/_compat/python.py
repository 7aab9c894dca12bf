"""Python's own private names recshard relies on: what the interpreter runs as it ends, how multiprocessing's
fork server starts a process, and the handle on the server its children inherit."""

from __future__ import annotations

import contextlib
import multiprocessing.context
import os
import sys
from collections.abc import Iterator
from typing import Any


def interpreter_exit() -> None:
    """What the interpreter runs as it ends, for a process that will leave with ``os._exit`` (a multiprocessing
    child, e.g. a test rank forked from :mod:`lightning_rec._forkserver`): ``threading._shutdown`` (the hooks that
    stop executor threads, then non-daemon threads joined), then the ``atexit`` handlers."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()


def forget_fork_server() -> None:
    """In a child of a fork server: close this process's end of the server's "alive" pipe and forget the server.

    Multiprocessing hands every child of its fork server the write end of the pipe whose closing ends the server
    (``forkserver.ForkServer._forkserver_alive_fd``, with ``_forkserver_address`` and ``_forkserver_pid``: private), so
    that the child could ask the same server for processes too; a child that keeps it keeps the server alive after
    the process that started the server is gone. Forgotten, a child that needs a fork server starts its own."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # (typeshed declares none of its private attributes)
    if server._forkserver_alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = server._forkserver_address = server._forkserver_pid = None


@contextlib.contextmanager
def _main_without_missing_file() -> Iterator[None]:
    # multiprocessing (spawn and forkserver) re-runs ``__main__`` in the child from ``__main__.__file__``; a script
    # read from standard input names "<stdin>", which the child cannot open (FileNotFoundError, and a DataLoader
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


class ForkServerProcess(multiprocessing.context.ForkServerProcess):
    """A process of :class:`ForkServerContext`: forked from the fork server unless its :meth:`start_method` says
    otherwise (a subclass overrides it)."""

    @staticmethod
    def start_method(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """How a process that runs ``target(*args, **kwargs)`` starts: ``"forkserver"``, another of
        multiprocessing's start methods, or ``None`` for multiprocessing's default (what a ``DataLoader`` without a
        context uses)."""
        return "forkserver"

    # ``_Popen`` is where multiprocessing starts the child, reading ``__main__`` for it (spawn.get_preparation_data);
    # ``_target``, ``_args`` and ``_kwargs`` are where a Process keeps what it will run.
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        method = process_obj.start_method(process_obj._target, process_obj._args, process_obj._kwargs)
        if method != "forkserver":
            return multiprocessing.get_context(method).Process._Popen(process_obj)
        with _main_without_missing_file():
            return multiprocessing.context.ForkServerProcess._Popen(process_obj)


class ForkServerContext(multiprocessing.context.ForkServerContext):
    """Multiprocessing's fork-server context whose processes also start from a script read from standard input
    (``python - < script.py``), which has no ``__main__`` file to run again in the child, and whose
    :class:`ForkServerProcess` may start one elsewhere (a subclass sets ``Process`` to its own).

    Example::

        DataLoader(dataset, num_workers=2, multiprocessing_context=ForkServerContext())
    """

    Process = ForkServerProcess
