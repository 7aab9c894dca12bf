"""Python's own private names recshard relies on: what the interpreter runs as it ends."""

from __future__ import annotations


def interpreter_exit() -> None:
    """What the interpreter runs as it ends, for a process that will leave with ``os._exit`` (a multiprocessing
    child, e.g. a test rank forked from :mod:`lightning_rec._forkserver`): ``threading._shutdown`` (the hooks that
    stop executor threads, then non-daemon threads joined), then the ``atexit`` handlers."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
