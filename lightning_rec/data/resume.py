"""Mid-epoch resumption of the training loaders, through Lightning's stateful-loader protocol.

Lightning saves the ``state_dict()`` of a training loader that has ``state_dict``/``load_state_dict`` in every
checkpoint, and a ``fit(ckpt_path=...)`` from a mid-epoch checkpoint hands it back before the epoch's first batch.
:class:`ResumableLoader` keeps which epoch its loader is in and how many of its batches were served; resumed, it
starts that epoch at the next batch. An epoch's batch order is a function of the seed, the epoch, the number of
ranks and the batch size (and, for a :class:`~lightning_rec.data.stream.TableStream`, the number of DataLoader
workers), so the resumed run trains the batches the interrupted one would have trained, in the same order.

A checkpoint saved mid-epoch by a run whose layout differs from this one (another rank count, batch size, or a
stream's worker count) cannot continue that way: its remaining batches would read some rows twice and others never.
:meth:`ResumableLoader.load_state_dict` refuses it before anything changes, naming both layouts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lightning_rec.errors import CheckpointError

__all__ = ["ResumableLoader", "pass_through"]


class ResumableLoader:
    """A training loader that Lightning resumes mid-epoch: it counts the batches it served (:meth:`state_dict`) and,
    after :meth:`load_state_dict`, starts the epoch at the next one.

    Attribute access and ``len()`` go to the wrapped DataLoader; ``sampler`` is the loader itself, so Lightning's
    ``sampler.set_epoch(epoch)`` reaches it (and, at the start of each pass, ``source``).

    Args:
        dataloader: the DataLoader to iterate.
        source: what orders the epoch: an object with ``set_epoch(epoch)`` and a ``start_batch`` attribute (how many
            of the epoch's first batches its next pass skips), e.g. the
            :class:`~lightning_rec.data.base.DistributedBatchSampler` of an in-memory dataset, a
            :class:`~lightning_rec.data.stream.TableStream` or a :class:`~lightning_rec.data.criteo.CriteoTSVStream`.
        world_size, batch_size: the layout the epoch's order depends on (checked on resume).
        num_workers: DataLoader workers, checked on resume only with ``workers_matter`` (a stream deals its batches
            to workers; a sampler in the main process orders them whatever the workers).

    Example::

        sampler = DistributedBatchSampler(dataset, 64, num_replicas=2, rank=0, shuffle=True)
        loader = ResumableLoader(DataLoader(dataset, sampler=sampler, batch_size=None), sampler,
                                 world_size=2, batch_size=64)
        loader.load_state_dict({"epoch": 3, "served": 10})   # the next pass is epoch 3 from its 11th batch
    """

    def __init__(
        self,
        dataloader: Any,
        source: Any,
        *,
        world_size: int = 1,
        batch_size: int | None = None,
        num_workers: int = 0,
        workers_matter: bool = False,
    ) -> None:
        self.dataloader, self.source = dataloader, source
        self.world_size, self.batch_size, self.num_workers = world_size, batch_size, num_workers
        self.workers_matter = workers_matter
        self.epoch, self.served, self.finished = 0, 0, False
        self._resume: tuple[int, int] | None = None  # (epoch, batches served) to resume at

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next pass (Lightning calls it through ``sampler.set_epoch`` at each epoch's start)."""
        self.epoch = epoch

    @property
    def sampler(self) -> ResumableLoader:
        """Lightning calls ``sampler.set_epoch(epoch)``: this loader is its own sampler."""
        return self

    def _sized(self) -> bool:
        try:
            len(self.dataloader)
        except TypeError:
            return False
        return True

    def __iter__(self) -> Iterator[Any]:
        self.source.set_epoch(self.epoch)
        # Only the saved epoch resumes: Lightning may go on to the next one instead (a checkpoint saved at the last
        # step of an epoch that `limit_train_batches` cut short).
        resume, self._resume = self._resume, None
        self.source.start_batch = resume[1] if resume is not None and resume[0] == self.epoch else 0
        self.served, self.finished = self.source.start_batch, False
        if self._sized():
            for batch in self.dataloader:
                self.served += 1
                yield batch
        else:
            # Without a length Lightning fetches one batch ahead (to know which batch is the last): a batch counts as
            # served once the next one is asked for, so a checkpoint holds the batches its steps trained.
            for batch in self.dataloader:
                yield batch
                self.served += 1
        self.finished = True

    def __len__(self) -> int:
        return len(self.dataloader)

    def state_dict(self) -> dict[str, Any]:
        """Where in which epoch the loader is (``epoch``, ``served``, ``finished``) and the layout its order depends
        on (``world_size``, ``batch_size``, ``num_workers``)."""
        return {
            "epoch": self.epoch,
            "served": self.served,
            "finished": self.finished,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next pass at batch ``served`` of epoch ``epoch`` (a mid-epoch checkpoint).

        Raises:
            CheckpointError: the checkpoint was saved mid-epoch by a run of another layout (see the module
                docstring); nothing was changed.
        """
        served = int(state["served"])
        ended = bool(state.get("finished")) or (self._sized() and served >= len(self))
        if served > 0 and not ended:
            self._check_layout(state, served)
        self.epoch = int(state["epoch"])
        self._resume = None if ended else (self.epoch, served)

    def _check_layout(self, state: dict[str, Any], served: int) -> None:
        compared = [("world_size", "process(es)", "devices x num_nodes"), ("batch_size", "rows a batch", "batch_size")]
        if self.workers_matter:
            compared.append(("num_workers", "DataLoader worker(s)", "num_workers"))
        saved, now, fixes = [], [], []
        for key, unit, setting in compared:
            was = state.get(key)  # absent from checkpoints older than the check: not comparable
            if was is not None and was != getattr(self, key):
                saved.append(f"{was} {unit}")
                now.append(f"{getattr(self, key)} {unit}")
                fixes.append(f"{setting}={was}")
        if saved:
            raise CheckpointError(
                f"{type(self).__name__}: the checkpoint was saved mid-epoch (after batch {served} of epoch "
                f"{state['epoch']}) by a run with {', '.join(saved)}; this run has {', '.join(now)}. The rest of that "
                f"epoch cannot be read with this layout without reading some rows twice and others never. HINT: resume "
                f"with {', '.join(fixes)} as when it was saved, or from a checkpoint saved at the end of an epoch."
            )

    def __getattr__(self, name: str) -> Any:
        if name in ("dataloader", "source", "stream"):  # not set yet (unpickling, or during __init__)
            raise AttributeError(name)
        return getattr(self.dataloader, name)


def pass_through(batch: Any) -> Any:
    """A ``collate_fn`` that hands the sampler's batch through as it is (the datasets and streams collate whole
    batches themselves).

    Example::

        >>> pass_through([1, 2])
        [1, 2]
    """
    return batch
