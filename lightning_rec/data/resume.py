"""Mid-epoch resumption of the training loaders, through Lightning's stateful-loader protocol.

Lightning saves the ``state_dict()`` of a training loader that has ``state_dict``/``load_state_dict`` in every
checkpoint, and a ``fit(ckpt_path=...)`` from a mid-epoch checkpoint hands it back before the epoch's first batch.
:class:`ResumableLoader` keeps which epoch its loader is in and how many of its batches were served; resumed, it
starts that epoch at the next batch. An epoch's batch order is a function of the seed, the epoch, the number of
ranks and the batch size (and, for a :class:`~lightning_rec.data.stream.TableStream`, the number of DataLoader
workers), so the resumed run trains the batches the interrupted one would have trained, in the same order.

A checkpoint saved mid-epoch by a run whose layout differs from this one (another rank count, batch size, or a
stream's worker count) resumes elastically when its loader can tell which rows the saved layout read (an in-memory
dataset's sampler, a :class:`~lightning_rec.data.stream.TableStream`: :mod:`lightning_rec.data.elastic`): those rows
are dropped and the rest of the epoch is cut over this run's ranks and workers, every row read once. What cannot be
exact is refused by :meth:`ResumableLoader.load_state_dict` before anything changes, naming both layouts: a loader
that cannot restripe (e.g. the Criteo TSV stream), data with another row count than when saved, a stream's other
``window``, or fewer rows left than ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lightning_rec.data.elastic import Leg
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
            A source that also has ``legs``, ``total_rows`` and ``rows_left(epoch, legs)`` resumes on another layout
            (:mod:`lightning_rec.data.elastic`).
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
        self._legs: list[Leg] = []  # the earlier legs of this epoch (an elastic resume)
        self._resume: tuple[int, int, list[Leg]] | None = None  # (epoch, batches served, earlier legs) to resume at

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
        served, legs = (resume[1], resume[2]) if resume is not None and resume[0] == self.epoch else (0, [])
        if self.elastic:
            self.source.legs = legs
        self.source.start_batch = served - (legs[-1].served if legs else 0)  # batches of this leg already served
        self.served, self.finished, self._legs = served, False, legs
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

    @property
    def elastic(self) -> bool:
        """Whether the source can resume an epoch saved on another layout (see the ``source`` argument)."""
        return all(hasattr(self.source, name) for name in ("legs", "total_rows", "rows_left"))

    @property
    def resumes_elastically(self) -> bool:
        """Whether the next pass reads the rest of an epoch saved on another layout (its length is that epoch's)."""
        return self._resume is not None and bool(self._resume[2])

    def state_dict(self) -> dict[str, Any]:
        """Where in which epoch the loader is (``epoch``, ``served``: steps since the epoch started, ``finished``),
        the layout its order depends on (``world_size``, ``batch_size``, ``num_workers``; a stream's ``window``) and,
        for a source that resumes elastically, the epoch's rows (``rows``) and earlier layouts (``legs``)."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "served": self.served,
            "finished": self.finished,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
        }
        if self.elastic:
            state["rows"] = int(self.source.total_rows)
            state["legs"] = [leg.as_dict() for leg in self._legs]
        if isinstance(getattr(self.source, "window", None), int):
            state["window"] = self.source.window
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next pass at batch ``served`` of epoch ``epoch`` (a mid-epoch checkpoint); one saved on another
        layout, at the rows it left (see the module docstring). Loading the same state twice is loading it once.

        Raises:
            CheckpointError: the checkpoint was saved mid-epoch and cannot be resumed exactly (see the module
                docstring); nothing was changed.
        """
        served, epoch = int(state["served"]), int(state["epoch"])
        legs = [Leg.from_dict(d) for d in state.get("legs", ())]
        if bool(state.get("finished")) or served == 0:
            self.epoch, self._resume = epoch, None
            return
        changed = self._changes(state)
        if (changed or legs) and self.elastic:
            self._check_elastic(state, served)
            left = self.source.rows_left(epoch, [*legs, self._saved_leg(state, served)])
            if left == 0:  # the saved run read the whole epoch
                self.epoch, self._resume = epoch, None
                return
            if changed and state.get("rows") is None:
                self._refuse(state, served, changed, " (the checkpoint predates elastic resume: it names no rows)")
            if changed:
                legs = [*legs, self._saved_leg(state, served)]
            if changed and left < self.world_size:
                raise CheckpointError(
                    f"{type(self).__name__}: the checkpoint was saved mid-epoch (after batch {served} of epoch {epoch}) "
                    f"with {left} row(s) of that epoch left, fewer than this run's {self.world_size} processes: "
                    "every rank needs one. HINT: resume with fewer processes, or from a checkpoint saved at the end of "
                    "an epoch."
                )
        elif changed:
            self._refuse(state, served, changed, "")
        elif self._sized() and served >= len(self):
            self.epoch, self._resume = epoch, None  # saved at the epoch's last step
            return
        self.epoch = epoch
        self._resume = (epoch, served, legs)
        if self.elastic:
            self.source.legs = legs  # len() now counts this epoch's steps (Lightning asks before the first pass)

    def _saved_leg(self, state: dict[str, Any], served: int) -> Leg:
        workers = state.get("num_workers") or 0
        return Leg(int(state["world_size"]), int(state["batch_size"]), int(workers), served)

    def _changes(self, state: dict[str, Any]) -> list[tuple[str, str, str]]:
        """The layout settings the checkpoint's epoch order differs in: ``(key, unit, setting)``."""
        compared = [("world_size", "process(es)", "devices x num_nodes"), ("batch_size", "rows a batch", "batch_size")]
        if self.workers_matter:
            compared.append(("num_workers", "DataLoader worker(s)", "num_workers"))
        # absent from checkpoints older than the check: not comparable
        return [c for c in compared if state.get(c[0]) is not None and state[c[0]] != getattr(self, c[0])]

    def _check_elastic(self, state: dict[str, Any], served: int) -> None:
        """Refuse, by name, what an elastic resume cannot make exact: other data, a stream's other window."""
        rows, total = state.get("rows"), int(self.source.total_rows)
        if rows is not None and int(rows) != total:
            raise CheckpointError(
                f"{type(self).__name__}: the checkpoint was saved mid-epoch (after batch {served} of epoch "
                f"{state['epoch']}) over {rows} rows; this run's data has {total}: which rows are left cannot be "
                "known. HINT: resume with the data it was saved with, or from a checkpoint saved at the end of an epoch."
            )
        window = getattr(self.source, "window", None)
        if state.get("window") is not None and state["window"] != window:
            raise CheckpointError(
                f"{type(self).__name__}: the checkpoint was saved mid-epoch (after batch {served} of epoch "
                f"{state['epoch']}) with window={state['window']}; this run has window={window}, and the window "
                f"decides which rows a half-read window held. HINT: resume with window={state['window']}."
            )

    def _refuse(self, state: dict[str, Any], served: int, changed: list[tuple[str, str, str]], why: str) -> None:
        saved = ", ".join(f"{state[key]} {unit}" for key, unit, _ in changed)
        now = ", ".join(f"{getattr(self, key)} {unit}" for key, unit, _ in changed)
        fixes = ", ".join(f"{setting}={state[key]}" for key, _, setting in changed)
        raise CheckpointError(
            f"{type(self).__name__}: the checkpoint was saved mid-epoch (after batch {served} of epoch "
            f"{state['epoch']}) by a run with {saved}; this run has {now}. The rest of that epoch cannot be read with "
            f"this layout without reading some rows twice and others never{why}. HINT: resume with {fixes} as when it "
            "was saved, or from a checkpoint saved at the end of an epoch."
        )

    def __getattr__(self, name: str) -> Any:
        if name in ("dataloader", "source", "stream", "_legs"):  # not set yet (unpickling, or during __init__)
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
