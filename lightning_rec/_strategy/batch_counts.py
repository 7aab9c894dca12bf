"""Every rank must run the same number of training batches: each batch's all-to-alls pair the ranks up, so a rank
with fewer batches does not wait for the others at its epoch's end. It pairs its next collectives (the next epoch's
first batch, or validation) with the other ranks' remaining batches: training goes on silently wrong, and the job
ends later in a bare transport timeout (torchrec#189; a user's own ``IterableDataset`` sharded by rank is the usual
cause).

:class:`BatchCounts` names it instead, without a per-step synchronisation:

* when the training loader has a length, the ranks compare lengths through the process group's key-value store
  before the first batch, and a mismatch is refused naming every rank's length;
* otherwise each rank records, when its loader runs out, how many batches it yielded; after its last training step
  it reads the others' counts. Lightning fetches one batch ahead, so a rank posts its count before its own last
  step, which the reading rank's last step paired with: in a run where the counts agree, every count is there. A
  count that is missing or different stops the job with an error saying which rank ran out after how many batches.

Example::

    counts = BatchCounts.for_default_group(token, rank=0, world_size=2)
    loader = counts.wrap(train_loader)     # the strategy's process_dataloader
    ...                                    # after each optimizer step:
    counts.check()                         # raises if a pass ended unequally
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_rec import _compat

__all__ = ["BatchCounts", "CountedLoader", "UnequalBatchesError"]

_HINT = (
    "HINT: give every rank the same number of batches: the DataModules here do (DistributedBatchSampler, "
    "lightning_rec.data.base.rank_batches); a DataLoader over a map-style dataset gets Lightning's "
    "DistributedSampler; an IterableDataset sharded by rank must yield equally many batches on every rank (drop or "
    "pad the remainder), or set `limit_train_batches` to the smallest count."
)


class UnequalBatchesError(RuntimeError):
    """Ranks ran different numbers of training batches (see :mod:`lightning_rec._strategy.batch_counts`)."""


class BatchCounts:
    """Compares the ranks' training batch counts through a key-value store (see the module docstring).

    Args:
        store: the process group's store (its server answers while a rank is blocked in a collective).
        token: a prefix shared by every rank of this run.
        rank, world_size: this rank and how many there are.
        wait: how long a rank that finished its pass waits for the others' counts (they are normally there already).
        owner: who the messages name.
    """

    def __init__(
        self,
        store: dist.Store,
        token: str,
        rank: int,
        world_size: int,
        wait: timedelta = timedelta(seconds=10),
        owner: str = "RecShardStrategy",
    ) -> None:
        self._store = dist.PrefixStore(f"lightning_rec/batch_counts/{token}/", store)
        self.rank, self.world_size, self.wait, self.owner = rank, world_size, wait, owner
        self._loaders = 0  # training loaders wrapped (Lightning reloads them on request)
        self._ended: str | None = None  # the key of a pass that ended and is not checked yet

    @classmethod
    def for_default_group(
        cls, token: str, rank: int, world_size: int, wait: timedelta = timedelta(seconds=10), owner: str = ""
    ) -> BatchCounts | None:
        """Counts on the default process group's store; ``None`` for one rank or without a process group."""
        store = _compat.default_store()
        if store is None or world_size < 2:
            return None
        return cls(store, token, rank, world_size, wait, owner or "RecShardStrategy")

    def wrap(self, dataloader: Any, limit: int | float | None = None, max_batches: int | None = None) -> CountedLoader:
        """The training loader, counted; if it has a length, the ranks' lengths are compared first.

        Args:
            limit: the Trainer's ``limit_train_batches`` (a count, or a fraction of the loader): the batches an
                epoch runs. Loaders of different lengths limited to the same count train as TorchRec would.
            max_batches: the Trainer's ``max_steps`` (``None``: no limit): a run that stops before the shortest
                loader runs out never meets the difference.

        Raises:
            UnequalBatchesError: if the ranks would run different numbers of batches in an epoch, naming each.
        """
        self._loaders += 1
        loader = CountedLoader(dataloader, self, f"loader{self._loaders}")
        try:
            length: int | None = len(dataloader)
        except TypeError:
            length = None
        if length is not None:
            if isinstance(limit, int):
                length = min(length, limit)
            elif limit is not None:
                length = int(length * limit)  # as Lightning counts a fraction
            lengths = self._exchange(f"loader{self._loaders}/len", length, timedelta(minutes=5))
            stops_first = max_batches is not None and max_batches <= min(lengths.values())
            if len(set(lengths.values())) > 1 and not stops_first:
                raise UnequalBatchesError(
                    f"{self.owner}: the ranks' training loaders have different lengths: "
                    + ", ".join(f"rank {r}: {n} batches" for r, n in sorted(lengths.items()))
                    + ". Every batch's all-to-alls pair the ranks up, so a rank with fewer batches would pair its "
                    f"next epoch (or validation) with the others' last batches. {_HINT}"
                )
        return loader

    def ended(self, key: str, count: int) -> None:
        """Record that this rank's pass ``key`` yielded ``count`` batches (called as its loader runs out)."""
        self._store.set(f"{key}/rank{self.rank}", str(count))
        self._ended = key

    def check(self) -> None:
        """After a training step: if this rank's loader ran out, compare the ranks' counts.

        Raises:
            UnequalBatchesError: naming the rank(s) that ran out after how many batches, and those that did not.
        """
        if self._ended is None:
            return
        key, self._ended = self._ended, None
        counts = self._collect(key, self.wait)
        mine = counts[self.rank]
        if len(counts) == self.world_size and len(set(counts.values())) == 1:
            return
        missing = [r for r in range(self.world_size) if r not in counts]
        ran_out = ", ".join(f"rank {r} after {n} batches" for r, n in sorted(counts.items()))
        still = (
            f"; rank(s) {', '.join(map(str, missing))} had not run out {self.wait.total_seconds():g} s after rank "
            f"{self.rank}'s last step (they have more batches)"
            if missing
            else ""
        )
        raise UnequalBatchesError(
            f"{self.owner}: the ranks ran different numbers of training batches in one epoch: {ran_out} ran out"
            f"{still}. Rank {self.rank} stopped here after its {mine} batches rather than pair its next collectives "
            f"with the others' remaining batches. {_HINT}"
        )

    def _exchange(self, key: str, value: int, timeout: timedelta) -> dict[int, int]:
        self._store.set(f"{key}/rank{self.rank}", str(value))
        self._store.wait([f"{key}/rank{r}" for r in range(self.world_size)], timeout)
        return {r: int(self._store.get(f"{key}/rank{r}")) for r in range(self.world_size)}

    def _collect(self, key: str, wait: timedelta) -> dict[int, int]:
        """The counts of ``key`` posted within ``wait`` (polled: a missing one must not block forever)."""
        names = [f"{key}/rank{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + wait.total_seconds()
        while not self._store.check(names) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {r: int(self._store.get(n)) for r, n in enumerate(names) if self._store.check([n])}


class CountedLoader:
    """A training loader whose passes are counted by :class:`BatchCounts`.

    Attribute access (``sampler``, ``dataset``, ``state_dict``, ...) and ``len()`` go to the wrapped loader, so
    Lightning's epoch handling (``set_epoch``, batch counts, mid-epoch resumption) is unchanged.
    """

    def __init__(self, dataloader: Any, counts: BatchCounts, key: str) -> None:
        self.dataloader = dataloader
        self._counts = counts
        self._key = key
        self._passes = 0

    def __iter__(self) -> Iterator[Any]:
        self._passes += 1
        key = f"{self._key}/pass{self._passes}"
        served = 0
        for batch in self.dataloader:
            served += 1
            yield batch
        self._counts.ended(key, served)

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataloader", "_counts", "_key", "_passes"):
            raise AttributeError(name)
        return getattr(self.dataloader, name)
