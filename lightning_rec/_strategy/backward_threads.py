"""The threads of the CPU lookup's split backward (:mod:`lightning_rec._strategy.cpu_lookup`): one pool per size,
shared by every lookup of the process (the backward of one module runs at a time), its threads born with one
intra-op thread each, stopped on request.

Why one intra-op thread: a thread that runs a GNU OpenMP parallel region with more than one thread keeps a team of
OpenMP workers of its own for as long as it lives; with more OpenMP threads alive than cores, libgomp spins 100 times
instead of 300,000 before an idle worker sleeps (its ``GOMP_SPINCOUNT`` rule), and every parallel region of the
process (the main thread's, FBGEMM's, the MLP's) then waits for its workers to wake up: 1.5-2.5x slower steps at the
small sizes before this module existed (``benchmarks/split_threads.py``; BENCHMARKS.md, "The split's threads slowed
the whole process"). Each group of tables is one thread's work already: the threads need no team.

Example::

    run_on_threads(update_group, [(grad, ids_a, offsets_a), (grad, ids_b, offsets_b)])   # two groups, two threads
    release_threads()                                                                      # none left
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["release_threads", "run_on_threads"]

_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def run_on_threads(call: Callable[..., None], calls: Sequence[tuple[Any, ...]]) -> None:
    """``call(*args)`` for every ``args`` of ``calls`` at once, each on a thread of its own, and wait for them all
    (the first error is raised). A thread whose intra-op thread count was set above one after its start (a library's
    first parallel loop on it, say) is not kept: the pool is stopped after the calls and starts anew next time."""
    pool, new = _pool(len(calls))
    if new:
        counts = _start_threads(pool, call, calls)
    else:
        counts = [future.result() for future in [pool.submit(_counted, call, *args) for args in calls]]
    if max(counts) > 1:
        release_threads()


def release_threads() -> bool:
    """Stop the split's backward threads, if any run (the next :func:`run_on_threads` starts them again), so that
    FBGEMM's path runs as in a process that never split. Returns whether there were any.

    Example::

        >>> _ = release_threads()   # stops them, if a split started them
        >>> release_threads()       # none left
        False
    """
    if not _POOLS:  # the common case, every step on FBGEMM's path: no lock taken
        return False
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.shutdown(wait=True)  # between steps: no backward is running
    return bool(pools)


def _pool(workers: int) -> tuple[ThreadPoolExecutor, bool]:
    # The process's pool of ``workers`` threads, and whether it is new (its threads not started yet).
    with _POOLS_LOCK:
        if workers in _POOLS:
            return _POOLS[workers], False
        _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="lightning_rec-tbe")
        return _POOLS[workers], True


def _counted(call: Callable[..., None], *args: Any) -> int:
    # ``call(*args)``, then the calling thread's intra-op thread count.
    call(*args)
    return torch.get_num_threads()


def _start_threads(pool: ThreadPoolExecutor, call: Callable[..., None], calls: Sequence[tuple[Any, ...]]) -> list[int]:
    """Run a new pool's first ``calls`` (one per thread, all at once), its threads born with one intra-op thread each.

    A new thread's OpenMP thread count is libgomp's default (the cores) until torch's first parallel loop on it sets
    it from torch's process-wide count, and FBGEMM's libraries run OpenMP regions of their own and set it likewise the
    first time each runs a parallel loop there: hence torch's count is one while the threads start and make their
    first calls (the caller waits for them meanwhile), and the caller's again after. (Another thread of the process
    whose first parallel loop fell in that window would get one intra-op thread too: torch's count is process-wide; a
    user's own threads rarely start during a backward.) Returns each thread's count after its call."""
    outer = torch.get_num_threads()
    barrier = threading.Barrier(len(calls))  # no call ends before all have begun: every call gets a thread of its own

    def first(*args: Any) -> int:
        barrier.wait()
        torch.get_num_threads()  # torch sets this thread's count (to one) before FBGEMM's OpenMP regions read it
        return _counted(call, *args)

    torch.set_num_threads(1)
    try:
        futures = []
        try:
            for args in calls:
                futures.append(pool.submit(first, *args))
        except BaseException:  # a thread that could not start: the started ones must not wait for it, ever
            barrier.abort()
            release_threads()
            raise
        return [future.result() for future in futures]
    finally:
        torch.set_num_threads(outer)
