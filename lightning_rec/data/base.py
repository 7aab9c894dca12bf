"""What every DataModule here shares: feature specs, columnar in-memory rows, and rank-aware batching.

Sharded embedding lookups are collectives: every rank must run the same number of batches, or the rank
with one batch more waits forever for the others. :class:`DistributedBatchSampler` guarantees that (and
covers every row exactly once, so metrics summed over ranks equal the single-process ones), while batch
sizes may differ by one row between ranks, which TorchRec's input distribution handles.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, cast

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec._compat.lightning import pending_loader_state
from lightning_rec._forkserver import worker_context
from lightning_rec.config import SparseFeature
from lightning_rec.data.elastic import Leg, Remaining, sampler_read
from lightning_rec.data.resume import ResumableLoader, pass_through
from lightning_rec.data.stream import StreamLoader, TableStream

# The Trainer's `reload_dataloaders_every_n_epochs` argument, kept as an attribute (set by its data connector, not
# declared on the class, hence getattr/setattr).
_RELOADS = "reload_dataloaders_every_n_epochs"

__all__ = [
    "DistributedBatchSampler",
    "Jagged",
    "RecDataModule",
    "RecDataset",
    "batch_loader",
    "rank_batches",
]


@dataclass(frozen=True)
class Jagged:
    """A multi-hot column: the ids of sample ``i`` are ``values[offsets[i]:offsets[i + 1]]``.

    Example::

        >>> j = Jagged.from_lists([[3, 5], [], [7]])
        >>> j.values.tolist(), j.offsets.tolist()
        ([3, 5, 7], [0, 2, 2, 3])
    """

    values: torch.Tensor
    offsets: torch.Tensor

    @staticmethod
    def from_lists(rows: Sequence[Sequence[int]]) -> Jagged:
        """The jagged column of ``rows`` (one list of ids per sample)."""
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        values = torch.tensor([v for r in rows for v in r], dtype=torch.long)
        return Jagged(values, offsets)

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(values, lengths)`` of the rows ``index``, in that order (vectorised, no Python loop)."""
        starts = self.offsets[index]
        lengths = self.offsets[index + 1] - starts
        total = int(lengths.sum())
        # position of each output value = its row's start + its rank inside the row
        row_starts = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths)
        return self.values[row_starts + torch.arange(total)], lengths


_Column = torch.Tensor | Jagged


class RecDataset(Dataset):
    """Rows held as columns (dense matrix, labels, one column per sparse feature), indexed a batch at a time.

    ``dataset[index_tensor]`` returns a whole :class:`~lightning_rec._batch.Batch` built with tensor ops, which
    is what makes a Python-free input path on CPU; ``dataset[i]`` returns a batch of one.

    Args:
        dense: ``(N, D)`` float dense features (``D`` may be 0).
        labels: ``(N,)`` float labels.
        sparse: feature name -> ``(N,)`` long ids (one per sample) or a :class:`Jagged` column (multi-hot).
            The ``KeyedJaggedTensor`` keys keep this order.
        weights: feature name -> a :class:`Jagged` of float weights parallel to that feature's ids (a weighted
            feature, e.g. for a position-weighted or weighted table); the batches then carry ``weights`` in their
            ``KeyedJaggedTensor``, 1.0 for the other features' ids.

    Example::

        >>> ds = RecDataset(torch.zeros(3, 1), torch.tensor([1., 0., 1.]),
        ...                 {"user": torch.tensor([4, 2, 9]), "genre": Jagged.from_lists([[1, 2], [], [3]])})
        >>> b = ds[torch.tensor([2, 0])]
        >>> b.sparse_features.keys(), b.sparse_features.lengths().tolist(), b.sparse_features.values().tolist()
        (['user', 'genre'], [1, 1, 1, 2], [9, 4, 3, 1, 2])
    """

    def __init__(
        self,
        dense: torch.Tensor,
        labels: torch.Tensor,
        sparse: Mapping[str, _Column],
        weights: Mapping[str, Jagged] | None = None,
    ) -> None:
        n = labels.shape[0]
        if dense.dim() != 2 or dense.shape[0] != n:
            raise ValueError(f"RecDataset: dense must be ({n}, D) like the labels, got {tuple(dense.shape)}.")
        for name, col in sparse.items():
            if len(col) != n:
                raise ValueError(f"RecDataset: sparse feature {name!r} has {len(col)} rows, the labels {n}.")
        self.dense = dense.float()
        self.labels = labels.float()
        self.sparse: dict[str, _Column] = dict(sparse)
        self.weights: dict[str, Jagged] = dict(weights or {})
        for name, w in self.weights.items():
            ids = self.sparse.get(name)
            if not isinstance(ids, Jagged) or not torch.equal(ids.offsets, w.offsets):
                raise ValueError(f"RecDataset: the weights of {name!r} must be a Jagged parallel to its ids.")

    def __len__(self) -> int:
        return self.labels.shape[0]

    def __getitem__(self, index: int | Sequence[int] | torch.Tensor) -> Batch:
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        values: list[torch.Tensor] = []
        lengths: list[torch.Tensor] = []
        weights: list[torch.Tensor] = []
        for name, col in self.sparse.items():
            if isinstance(col, Jagged):
                v, n = col.take(index)
            else:
                v, n = col[index], torch.ones(index.numel(), dtype=torch.long)
            values.append(v)
            lengths.append(n)
            if self.weights:
                weights.append(
                    self.weights[name].take(index)[0].float() if name in self.weights else torch.ones(len(v))
                )
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=list(self.sparse),
            values=torch.cat(values).long(),
            lengths=torch.cat(lengths).int(),
            weights=torch.cat(weights) if weights else None,
        )
        return Batch(dense_features=self.dense[index], sparse_features=kjt, labels=self.labels[index])

    def subset(self, index: torch.Tensor) -> RecDataset:
        """The rows ``index`` as a new dataset (e.g. a train/validation split)."""

        def jagged(col: Jagged) -> Jagged:
            v, n = col.take(index)
            offsets = torch.zeros(index.numel() + 1, dtype=torch.long)
            torch.cumsum(n, 0, out=offsets[1:])
            return Jagged(v, offsets)

        sparse: dict[str, _Column] = {
            n: jagged(c) if isinstance(c, Jagged) else c[index] for n, c in self.sparse.items()
        }
        weights = {name: jagged(w) for name, w in self.weights.items()}
        return RecDataset(self.dense[index], self.labels[index], sparse, weights)


def rank_batches(
    num_rows: int,
    batch_size: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
) -> list[torch.Tensor]:
    """Split ``num_rows`` rows into this rank's batches; every rank gets the same number of batches.

    The (optionally shuffled, by ``seed + epoch``) rows are cut into ``world_size`` contiguous parts whose
    sizes differ by at most one; each part is cut into ``ceil(ceil(num_rows / world_size) / batch_size)``
    batches whose sizes differ by at most one. So every row is used exactly once per epoch, no batch exceeds
    ``batch_size``, and all ranks step together.

    Example::

        >>> [b.tolist() for b in rank_batches(7, 2, rank=1, world_size=2)]
        [[4, 5], [6]]
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if num_rows < world_size:
        raise ValueError(
            f"Cannot give each of {world_size} ranks at least one of {num_rows} rows; use fewer processes or more data."
        )
    return _stripe(_epoch_order(num_rows, shuffle, seed, epoch), batch_size, rank, world_size)


def _epoch_order(num_rows: int, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    if shuffle:
        return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))
    return torch.arange(num_rows)


def _stripe(order: torch.Tensor, batch_size: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """Rank ``rank``'s batches of the rows ``order`` (see :func:`rank_batches`)."""
    mine = torch.tensor_split(order, world_size)[rank]
    num_batches = math.ceil(math.ceil(len(order) / world_size) / batch_size)
    return list(torch.tensor_split(mine, num_batches))


class DistributedBatchSampler(DistributedSampler):
    """Yields this rank's batches of row indices (see :func:`rank_batches`); use with ``batch_size=None``.

    It is a ``DistributedSampler`` so that Lightning keeps it (instead of injecting its own, which would pad
    with repeated rows) and calls :meth:`set_epoch` on it, which reshuffles each epoch. A pass skips the epoch's
    first ``start_batch`` batches (a resumed epoch: :class:`~lightning_rec.data.resume.ResumableLoader` sets it;
    ``len()`` stays the epoch's). After an elastic resume (``legs``: the epoch's earlier layouts, see
    :mod:`lightning_rec.data.elastic`) the pass cuts only the rows they left, the same way. With ``with_epoch`` it
    yields ``(epoch, indices)``, for a dataset whose rows depend on the epoch (e.g. sampled negatives) whatever the
    rank and the DataLoader worker that reads them.

    Example::

        sampler = DistributedBatchSampler(dataset, batch_size=512, num_replicas=2, rank=0, shuffle=True)
        loader = DataLoader(dataset, sampler=sampler, batch_size=None)   # dataset[indices] -> Batch
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = False,
        seed: int = 0,
        with_epoch: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.batch_size = batch_size
        self.with_epoch = with_epoch
        self.start_batch = 0  # batches of the epoch the next pass skips (a resumed epoch, see ResumableLoader)
        self.legs: list[Leg] = []  # the earlier layouts of an elastically resumed epoch (see ResumableLoader)
        self._num_batches = len(self._batches())

    @property
    def total_rows(self) -> int:
        """The rows an epoch reads."""
        return len(cast(Sized, self.dataset))

    def remaining(self, legs: Sequence[Leg]) -> Remaining:
        """The positions of an epoch's row order that ``legs`` (saved layouts, in turn) did not read."""
        left, before = Remaining.whole(self.total_rows), 0
        for leg in legs:
            left, before = left.without(sampler_read(len(left), leg, leg.served - before)), leg.served
        return left

    def rows_left(self, epoch: int, legs: Sequence[Leg]) -> int:
        """How many rows of an epoch ``legs`` left (the same in every epoch)."""
        return len(self.remaining(legs))

    def _batches(self) -> list[torch.Tensor]:
        if self.legs:
            order = _epoch_order(self.total_rows, self.shuffle, self.seed, self.epoch)
            left = order[torch.from_numpy(self.remaining(self.legs).positions())]
            return _stripe(left, self.batch_size, self.rank, self.num_replicas)
        return rank_batches(
            len(cast(Sized, self.dataset)),  # a map-style dataset (DistributedSampler's too)
            self.batch_size,
            rank=self.rank,
            world_size=self.num_replicas,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=self.epoch,
        )

    def __iter__(self) -> Iterator[Any]:
        batches = self._batches()[self.start_batch :]
        if self.with_epoch:
            return ((self.epoch, b) for b in batches)
        return iter(batches)

    def __len__(self) -> int:
        if self.legs:
            left = self.rows_left(self.epoch, self.legs)
            return self.legs[-1].served + math.ceil(math.ceil(left / self.num_replicas) / self.batch_size)
        return self._num_batches


def batch_loader(
    dataset: Any,
    batch_size: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = False,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    with_epoch: bool = False,
) -> DataLoader:
    """A ``DataLoader`` over a dataset indexed by batches of row indices (``dataset[indices] -> Batch``, or
    ``dataset[(epoch, indices)]`` with ``with_epoch``).

    Worker processes are forked from the package's fork server (:mod:`lightning_rec._forkserver`: the package
    imported once, not ~4 s of imports per worker, and not forked from the training process, whose gloo threads could
    hold a lock at the fork) where it can serve them, else started as PyTorch would (a dataset class defined in a
    notebook cell or a script read from standard input, a lambda, a kernel's fork server seen from a rank forked
    from it: ``worker_start_method`` says when and why). With
    ``pin_memory`` (for CUDA training) batches land in pinned host memory, from which the strategy's non-blocking
    copy overlaps the GPU's work.

    Example::

        loader = batch_loader(RecDataset(...), 512, rank=trainer.global_rank, world_size=trainer.world_size)
    """
    sampler = DistributedBatchSampler(
        dataset, batch_size, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, with_epoch=with_epoch
    )
    return DataLoader(
        dataset,
        sampler=sampler,
        batch_size=None,
        collate_fn=pass_through,
        num_workers=num_workers,
        multiprocessing_context=worker_context() if num_workers > 0 else None,
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,
    )


class RecDataModule(pl.LightningDataModule):
    """Base of the DataModules here: publishes the features a model needs and owns the rank-aware loaders.

    A subclass sets :attr:`sparse_features` and :attr:`num_dense_features` (the CLI links both to the model) and
    overrides one method, :meth:`split`: the dataset of a split, built on first use. The base turns it into the
    split's loader (:meth:`dataloader`, which the four ``*_dataloader`` hooks call), by what :meth:`split` returns:

    * a map-style dataset indexed by a tensor of row indices (``dataset[indices]`` -> a whole batch): a
      :func:`batch_loader` for this rank, shuffled for training only; ``batch_size`` rows per training batch,
      :attr:`eval_batch_size` per evaluation batch. A dataset whose ``indexed_by_epoch`` is true is indexed by
      ``(epoch, indices)`` instead;
    * a :class:`~lightning_rec.data.stream.TableStream`: a :class:`~lightning_rec.data.stream.StreamLoader`;
    * any other ``IterableDataset`` (it yields this rank's batches itself): a ``DataLoader`` with ``batch_size=None``;
    * ``None`` (the data has no such split): no batches (``[]``), e.g. ``fit`` without validation.

    The training loader resumes mid-epoch exactly (:class:`~lightning_rec.data.resume.ResumableLoader`: Lightning
    saves where in the epoch it is in every checkpoint): a map-style dataset's, a stream's, and an
    ``IterableDataset``'s that can skip the first batches of an epoch (its ``start_batch`` attribute and
    ``set_epoch``, as :class:`~lightning_rec.data.criteo.CriteoTSVStream` has).

    Args:
        batch_size: rows per batch on each rank.
        num_workers: DataLoader worker processes per rank.
        seed: shuffling seed (reshuffled every epoch).

    Attributes:
        eval_batch_size: rows per batch of the evaluation splits (``val``, ``test``, ``predict``): ``batch_size``
            unless a subclass takes its own.

    Example::

        class Ones(RecDataModule):
            sparse_features = [SparseFeature("user", 10)]
            num_dense_features = 1

            def split(self, name):
                return RecDataset(torch.ones(8, 1), torch.ones(8), {"user": torch.arange(8)})
    """

    def __init__(self, batch_size: int = 512, num_workers: int = 0, seed: int = 0) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"{type(self).__name__}: batch_size must be >= 1, got {batch_size}.")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.eval_batch_size = batch_size
        self._reload_setting: int | None = None  # the trainer's, while an elastic epoch has it reload the loader

    @property
    def sparse_features(self) -> list[SparseFeature]:
        """The categorical features, in ``KeyedJaggedTensor`` key order."""
        raise NotImplementedError

    @property
    def num_dense_features(self) -> int:
        """The width of ``Batch.dense_features``."""
        raise NotImplementedError

    @property
    def rank_and_world_size(self) -> tuple[int, int]:
        """``(global rank, world size)`` of the attached trainer; ``(0, 1)`` without one."""
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    @property
    def pin_memory(self) -> bool:
        """Whether loaders pin their batches: when the attached trainer trains on CUDA."""
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        return device is not None and device.type == "cuda"

    def split(self, name: str) -> Any:
        """The dataset of split ``name`` (``"train"``, ``"val"``, ``"test"`` or ``"predict"``): the one method a
        subclass overrides (see the class docstring for what it may return). It is called each time a loader is
        made, so a subclass builds its splits once and keeps them."""
        raise NotImplementedError(f"{type(self).__name__} must implement split(name).")

    def dataloader(self, name: str) -> Any:
        """The loader of split ``name`` over :meth:`split` (see the class docstring), for this rank."""
        dataset = self.split(name)
        if dataset is None:
            return []  # Lightning runs no batches from an empty list
        if isinstance(dataset, TableStream):
            stream = StreamLoader(dataset, num_workers=self.num_workers, pin_memory=self.pin_memory)
            return self._resumed(stream) if name == "train" else stream
        if isinstance(dataset, IterableDataset):
            resumable = name == "train" and isinstance(getattr(dataset, "start_batch", None), int)
            loader = DataLoader(
                dataset,
                batch_size=None,
                num_workers=self.num_workers,
                # a resumed pass tells its workers where to start: they get a fresh copy of the dataset each pass
                persistent_workers=self.num_workers > 0 and not resumable,
                multiprocessing_context=worker_context() if self.num_workers > 0 else None,
                pin_memory=self.pin_memory,
            )
            if not resumable:
                return loader
            world_size = self.rank_and_world_size[1]
            return ResumableLoader(
                loader, dataset, world_size=world_size, batch_size=self.batch_size, num_workers=self.num_workers
            )
        rank, world_size = self.rank_and_world_size
        train = name == "train"
        batch_size = self.batch_size if train else self.eval_batch_size
        loader = batch_loader(
            dataset,
            batch_size,
            rank=rank,
            world_size=world_size,
            shuffle=train,
            seed=self.seed,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            with_epoch=bool(getattr(dataset, "indexed_by_epoch", False)),
        )
        if not train:
            return loader  # Lightning's evaluation loops want the DataLoader itself (predict tracks its indices)
        # The sampler orders the epoch in this process, whatever the workers: a worker count change resumes exactly.
        return self._resumed(
            ResumableLoader(
                loader, loader.sampler, world_size=world_size, batch_size=batch_size, num_workers=self.num_workers
            )
        )

    def _resumed(self, loader: ResumableLoader) -> ResumableLoader:
        """``loader`` with the state a resumed fit will load already loaded.

        Lightning takes the training loader's length, which fixes the epoch's steps and when it validates, before it
        loads the checkpoint's loader state, and keeps that length for the following epochs. An elastically resumed
        epoch (:mod:`lightning_rec.data.elastic`) has its own length: the state is loaded here first, and Lightning
        is asked (``reload_dataloaders_every_n_epochs``, for one epoch) to take the loader again after that epoch.
        """
        self._restore_reloads()  # the epoch after an elastic one
        state = pending_loader_state(self.trainer)
        if state is None:
            return loader
        loader.load_state_dict(state)
        if loader.resumes_elastically and self.trainer is not None:
            self._reload_setting = getattr(self.trainer, _RELOADS)
            setattr(self.trainer, _RELOADS, 1)
        return loader

    def _restore_reloads(self) -> None:
        """Give the trainer back the ``reload_dataloaders_every_n_epochs`` an elastic epoch borrowed."""
        if self._reload_setting is not None and self.trainer is not None:
            setattr(self.trainer, _RELOADS, self._reload_setting)
        self._reload_setting = None

    def teardown(self, stage: str) -> None:
        """The end of a fit (or any stage): the trainer's settings as they were (a fit may end in an elastic epoch)."""
        self._restore_reloads()

    def train_dataloader(self) -> Any:
        return self.dataloader("train")

    def val_dataloader(self) -> Any:
        return self.dataloader("val")

    def test_dataloader(self) -> Any:
        return self.dataloader("test")

    def predict_dataloader(self) -> Any:
        return self.dataloader("predict")
