"""Elastic resume: the rows an interrupted epoch has left, known from the checkpoint alone, restriped over a new layout.

An epoch's rows have one global order (the seeded shuffle of ``seed + epoch``, whatever the layout). A layout (ranks,
rows a batch, DataLoader workers) cuts that order into each rank's batches; every rank steps together, so "``served``
steps of this epoch" names the same number of batches on every rank and, with the layout, exactly which rows of the
order were read: the union over all ranks and workers is computed from the one loader state Lightning saves (rank
0's), nothing is gathered. A run resumed on another layout drops those rows and cuts the rest (the epoch's order
without them) the same way over its own ranks and workers: a new *leg* of the epoch. A leg saved mid-way and resumed
on yet another layout adds one more; each leg reads a subset of the rows its predecessors left.

::

    epoch order   0 1 2 3 4 5 6 7 8 9 10 11 ... 19       (20 rows, batch_size 2)
    leg 0: 2 ranks, 2 steps served        rank 0 read 0-3, rank 1 read 10-13
    leg 1: 1 rank, on what is left        4 5 6 7 8 9 14 15 16 17 18 19  -> batches (4 5) (6 7) ... (18 19)

:class:`Leg` is one leg as the checkpoint holds it; :class:`Remaining` the positions of the order not yet read, as
sorted runs (a few per rank and worker, not one number per row: an epoch of a billion rows stays small);
:func:`sampler_read` and :func:`stream_read` which positions one leg read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["Leg", "Remaining", "sampler_read", "stream_read"]


@dataclass(frozen=True)
class Leg:
    """One layout's part of an epoch: ``world_size`` ranks of ``batch_size`` rows a batch with ``num_workers``
    DataLoader workers, until the epoch had ``served`` steps (counted from the epoch's start, earlier legs included).

    Example::

        >>> Leg(2, 16, 0, served=3).as_dict()
        {'world_size': 2, 'batch_size': 16, 'num_workers': 0, 'served': 3}
    """

    world_size: int
    batch_size: int
    num_workers: int
    served: int

    def as_dict(self) -> dict[str, int]:
        """The leg as a checkpoint keeps it (plain ints)."""
        return asdict(self)

    @staticmethod
    def from_dict(state: Mapping[str, Any]) -> Leg:
        """A leg read back from :meth:`as_dict`."""
        return Leg(int(state["world_size"]), int(state["batch_size"]), int(state["num_workers"]), int(state["served"]))


class Remaining:
    """The positions of an epoch's order not read yet, in order, as runs ``[start, start + length)``; index ``i``
    of a leg's order is the ``i``-th of them.

    Example::

        >>> left = Remaining.whole(10).without([(0, 2), (5, 7)])
        >>> len(left), left.ranges(1, 5)
        (6, [(3, 5), (7, 9)])
    """

    def __init__(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        keep = lengths > 0
        self.starts, self.lengths = starts[keep].astype(np.int64), lengths[keep].astype(np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    @staticmethod
    def whole(n: int) -> Remaining:
        """All ``n`` positions."""
        return Remaining(np.array([0]), np.array([n]))

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def ranges(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The positions of indices ``[lo, hi)``, as ``[start, stop)`` ranges in order."""
        out: list[tuple[int, int]] = []
        i = int(np.searchsorted(self._offsets, lo, side="right")) - 1
        while lo < hi:
            take = min(hi, int(self._offsets[i + 1])) - lo
            start = int(self.starts[i]) + lo - int(self._offsets[i])
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], start + take)
            else:
                out.append((start, start + take))
            lo += take
            i += 1
        return out

    def positions(self) -> np.ndarray:
        """Every remaining position, in order (one number per row: for data held in memory)."""
        if not len(self.starts):
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(s, s + n) for s, n in zip(self.starts, self.lengths)])

    def without(self, read: Sequence[tuple[int, int]]) -> Remaining:
        """What is left once the index ranges ``read`` (of this order, disjoint) are read."""
        cuts = sorted((a, b) for a, b in read if b > a)
        kept: list[tuple[int, int]] = []
        at = 0
        for a, b in cuts:
            if a > at:
                kept.append((at, a))
            at = max(at, b)
        if at < len(self):
            kept.append((at, len(self)))
        runs = [r for lo, hi in kept for r in self.ranges(lo, hi)]
        return Remaining(np.array([a for a, _ in runs], dtype=np.int64), np.array([b - a for a, b in runs]))


def tensor_split_edges(n: int, parts: int) -> list[int]:
    """Boundaries of ``torch.tensor_split(range(n), parts)``: the first ``n % parts`` pieces one longer."""
    size, extra = divmod(n, parts)
    return [i * size + min(i, extra) for i in range(parts + 1)]


def sampler_read(n: int, leg: Leg, steps: int) -> list[tuple[int, int]]:
    """The index ranges an in-memory leg of ``n`` rows read in its ``steps`` steps
    (:func:`~lightning_rec.data.base.rank_batches`' cut: ranks, then batches, by ``tensor_split``).

    Example::

        >>> sampler_read(20, Leg(2, 2, 0, served=2), 2)
        [(0, 4), (10, 14)]
    """
    out = []
    ranks = tensor_split_edges(n, leg.world_size)
    num_batches = math.ceil(math.ceil(n / leg.world_size) / leg.batch_size)
    for r in range(leg.world_size):
        lo, hi = ranks[r], ranks[r + 1]
        out.append((lo, lo + tensor_split_edges(hi - lo, num_batches)[min(steps, num_batches)]))
    return out


def cut(n: int, parts: int) -> list[int]:
    """Boundaries of ``n`` items cut into ``parts`` contiguous pieces whose sizes differ by at most one."""
    return [(n * i) // parts for i in range(parts + 1)] if parts else [0]


def stream_read(
    n: int,
    leg: Leg,
    steps: int,
    window: int,
    permutation: Callable[[int, int, int], np.ndarray] | None,
    served_by: Callable[[int, Sequence[int]], tuple[list[int], int]],
) -> list[tuple[int, int]]:
    """The index ranges a streamed leg of ``n`` rows read in its ``steps`` steps
    (:class:`~lightning_rec.data.stream.TableStream`'s cut: ranks, batches, workers' runs, windows).

    Whole windows are contiguous; the last window a worker started was permuted (``permutation(rank, w0, rows)``:
    the window's row order, ``None`` without shuffling) and its first batches hold a scattered subset of its rows.
    ``served_by(steps, batches per worker)`` is how many batches each worker yielded.
    """
    out: list[tuple[int, int]] = []
    workers = max(1, leg.num_workers)
    num_batches = math.ceil(math.ceil(n / leg.world_size) / leg.batch_size)
    ranks = cut(n, leg.world_size)
    runs = cut(num_batches, workers)
    done, _ = served_by(min(steps, num_batches), [b - a for a, b in zip(runs[:-1], runs[1:])])
    for r in range(leg.world_size):
        lo = ranks[r]
        edges = cut(ranks[r + 1] - lo, num_batches)
        bounds = [(lo + a, lo + b) for a, b in zip(edges[:-1], edges[1:])]
        for w in range(workers):
            first, stop, k = runs[w], runs[w + 1], done[w]
            if k == 0:
                continue
            w0 = first + ((k - 1) // window) * window
            w1 = min(w0 + window, stop)
            last = first + k  # the first batch not served
            if last == w1 or permutation is None:
                out.append((bounds[first][0], bounds[last - 1][1]))
                continue
            out.append((bounds[first][0], bounds[w0][0]))  # the whole windows before
            a = bounds[w0][0]
            perm = permutation(r, w0, bounds[w1 - 1][1] - a)
            taken = np.sort(perm[: bounds[last - 1][1] - a]) + a
            breaks = np.flatnonzero(np.diff(taken) != 1) + 1
            for piece in np.split(taken, breaks):
                out.append((int(piece[0]), int(piece[-1]) + 1))
    return out
