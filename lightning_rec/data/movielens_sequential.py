"""MovieLens-100K as next-item prediction: each user's time-ordered items, split leave-one-out.

Every rating counts as an interaction (implicit feedback, the usual protocol of SASRec/BERT4Rec on MovieLens):
a user's items are ordered by timestamp, ties broken by file order. The **last** item is the user's test target,
the **second last** the validation target, the rest is training history. Users with fewer than 3 ratings (none
in MovieLens-100K, where everyone has 20 or more) are left out of validation and test and train on all they have.

Training rows are one sequence per user, SASRec-style: the input is the training history without its last item,
the targets are the same history shifted by one (position ``t`` predicts item ``t + 1``), both cut to the last
``max_len`` positions. Each row also carries ``num_negatives`` sampled negative items, drawn from a generator
seeded by ``seed`` and the epoch, per user row (so the same user gets the same negatives in an epoch whatever the
batching and the number of ranks). Evaluation rows hold the history up to the held-out item (cut to ``max_len``),
the held-out item, and every item the user has seen before it (excluded from the ranking).

A batch is a dict::

    features      KeyedJaggedTensor, keys FEATURES, all read by ONE item table (EmbeddingCollection):
                    history    the input sequence (jagged: one length per user)
                    target     train: the next item of each position (same lengths as history); eval: the
                               held-out item (length 1)
                    negatives  train: num_negatives sampled items per row; eval: none
                    catalog    eval: every item id 0..num_items-1 on the batch's first row (what is ranked); train: none
    users         (B,) long user ids
    seen_values   the items to exclude from each row's ranking (eval; empty in training), concatenated
    seen_lengths  (B,) how many of them each row has

Item ids are :func:`~lightning_rec.data.movielens.load_interactions`' (from 1; id 0 never occurs and is never
ranked).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec.config import SparseFeature
from lightning_rec.data.base import DistributedBatchSampler, Jagged, RecDataModule, identity
from lightning_rec.data.movielens import load_interactions, prepare_movielens
from lightning_rec.metrics import target_rank

__all__ = [
    "FEATURES",
    "LeaveOneOut",
    "MovieLensSequenceDataModule",
    "SequenceDataset",
    "exclusion_mask",
    "leave_one_out",
    "popularity_baseline",
    "popularity_ranks",
]

FEATURES = ("history", "target", "negatives", "catalog")
"""The KJT keys of a sequence batch, all read by the one item table."""


def _jagged(values: torch.Tensor, lengths: torch.Tensor) -> Jagged:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return Jagged(values.long(), offsets)


def _rows(j: Jagged) -> list[torch.Tensor]:
    return [j.values[j.offsets[i] : j.offsets[i + 1]] for i in range(len(j))]


@dataclass(frozen=True)
class LeaveOneOut:
    """Each user's time-ordered items, split leave-one-out.

    Attributes:
        users: ``(U,)`` the user ids, ascending (every user with at least one interaction).
        train: per user, the training items in time order (all but the last two; all for users with < 3 items).
        val: ``(U,)`` the second-last item, or -1 for users with < 3 items.
        test: ``(U,)`` the last item, or -1 for users with < 3 items.

    Example::

        >>> s = leave_one_out(torch.tensor([1, 1, 1, 1]), torch.tensor([5, 6, 7, 8]), torch.tensor([3, 1, 2, 2]))
        >>> s.train.values.tolist(), s.val.tolist(), s.test.tolist()   # times 1, 2, 2 (file order), 3
        ([6, 7], [8], [5])
    """

    users: torch.Tensor
    train: Jagged
    val: torch.Tensor
    test: torch.Tensor

    def evaluated(self) -> torch.Tensor:
        """Indices (into :attr:`users`) of the users with a validation and a test item."""
        return (self.test >= 0).nonzero().squeeze(1)


def leave_one_out(user: torch.Tensor, item: torch.Tensor, timestamp: torch.Tensor) -> LeaveOneOut:
    """Order each user's interactions by time (ties: the order given) and hold out the last two.

    Args:
        user, item, timestamp: ``(N,)`` one interaction each, e.g. :class:`~lightning_rec.data.movielens.Interactions`.

    Returns:
        the :class:`LeaveOneOut` split.

    Example::

        >>> s = leave_one_out(torch.tensor([2, 1, 2, 2]), torch.tensor([9, 4, 8, 7]), torch.tensor([0, 5, 1, 2]))
        >>> s.users.tolist(), s.train.values.tolist(), s.val.tolist(), s.test.tolist()
        ([1, 2], [4, 9], [-1, 8], [-1, 7])
    """
    if not (user.shape == item.shape == timestamp.shape) or user.dim() != 1:
        raise ValueError(
            f"leave_one_out: user, item and timestamp must be 1-D of one length, got {tuple(user.shape)}, "
            f"{tuple(item.shape)}, {tuple(timestamp.shape)}. HINT: pass Interactions' columns."
        )
    by_time = torch.sort(timestamp, stable=True).indices
    order = by_time[torch.sort(user[by_time], stable=True).indices]  # by user, then time, then file order
    users, counts = torch.unique_consecutive(user[order], return_counts=True)
    items = item[order]
    ends = torch.cumsum(counts, 0)
    evaluated = counts >= 3
    test = torch.where(evaluated, items[ends - 1], torch.full_like(users, -1))
    val = torch.where(evaluated, items[(ends - 2).clamp(min=0)], torch.full_like(users, -1))
    train_len = torch.where(evaluated, counts - 2, counts)
    position = torch.arange(items.numel()) - torch.repeat_interleave(ends - counts, counts)
    keep = position < torch.repeat_interleave(train_len, counts)
    return LeaveOneOut(users, _jagged(items[keep], train_len), val, test)


def _from_rows(rows: list[torch.Tensor], max_len: int | None = None) -> Jagged:
    """The rows as a :class:`Jagged`, each cut to its last ``max_len`` items (all when ``None``)."""
    rows = [r[-max_len:] for r in rows] if max_len is not None else rows
    values = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    return _jagged(values, torch.tensor([r.numel() for r in rows], dtype=torch.long))


class SequenceDataset:
    """One split's rows (see the module docstring), indexed a batch at a time: ``dataset[indices]`` or
    ``dataset[(epoch, indices)]`` (training: the epoch picks the negatives) returns a batch dict.

    Args:
        users: ``(R,)`` user id of each row.
        history: the input sequence of each row.
        target: train: the next item of each input position (same lengths as ``history``); eval: one item per row.
        seen: eval: the items excluded from each row's ranking; ``None`` in training.
        num_items: rows of the item table (the catalog ranked at evaluation is ``0..num_items-1``).
        num_negatives: sampled negatives per training row (0 for evaluation).
        seed: seeds the negatives (with the epoch).

    Example::

        >>> ds = SequenceDataset(torch.tensor([7]), Jagged.from_lists([[1, 2]]), Jagged.from_lists([[2, 3]]), None,
        ...                      num_items=5, num_negatives=2)
        >>> b = ds[(0, torch.tensor([0]))]
        >>> b["features"].keys(), b["features"].lengths().tolist()
        (['history', 'target', 'negatives', 'catalog'], [2, 2, 2, 0])
    """

    def __init__(
        self,
        users: torch.Tensor,
        history: Jagged,
        target: Jagged,
        seen: Jagged | None,
        num_items: int,
        num_negatives: int = 0,
        seed: int = 0,
    ) -> None:
        if not (len(history) == len(target) == users.numel()) or (seen is not None and len(seen) != users.numel()):
            raise ValueError(
                f"SequenceDataset: users ({users.numel()}), history ({len(history)}), target ({len(target)})"
                f"{'' if seen is None else f' and seen ({len(seen)})'} must have one row per user. HINT: build them "
                "from one leave_one_out() split."
            )
        if num_negatives < 0 or (num_negatives and num_items < 2):
            raise ValueError(
                f"SequenceDataset: num_negatives must be >= 0 (with >= 2 items), got {num_negatives} with {num_items} "
                "items. HINT: 0 for evaluation rows, e.g. 100 for training rows."
            )
        self.users, self.history, self.target, self.seen = users.long(), history, target, seen
        self.num_items, self.num_negatives, self.seed = num_items, num_negatives, seed
        self._negatives: tuple[int, torch.Tensor] | None = None  # (epoch, its negatives)

    def __len__(self) -> int:
        return self.users.numel()

    def negatives(self, epoch: int) -> torch.Tensor:
        """``(R, num_negatives)`` item ids in ``[1, num_items)`` of every row in ``epoch`` (seeded by seed and epoch)."""
        if self._negatives is None or self._negatives[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._negatives = (epoch, torch.randint(1, self.num_items, (len(self), self.num_negatives), generator=g))
        return self._negatives[1]

    def __getitem__(self, key: torch.Tensor | tuple[int, torch.Tensor] | int) -> dict[str, Any]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        b = index.numel()
        hist_v, hist_l = self.history.take(index)
        tgt_v, tgt_l = self.target.take(index)
        if self.num_negatives:
            neg_v = self.negatives(epoch)[index].reshape(-1)
            neg_l = torch.full((b,), self.num_negatives, dtype=torch.long)
        else:
            neg_v, neg_l = torch.zeros(0, dtype=torch.long), torch.zeros(b, dtype=torch.long)
        cat_l = torch.zeros(b, dtype=torch.long)
        if self.seen is not None:  # evaluation: the whole catalog, once per batch
            cat_v = torch.arange(self.num_items)
            cat_l[0] = self.num_items
            seen_v, seen_l = self.seen.take(index)
        else:
            cat_v = torch.zeros(0, dtype=torch.long)
            seen_v, seen_l = torch.zeros(0, dtype=torch.long), torch.zeros(b, dtype=torch.long)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=list(FEATURES),
            values=torch.cat([hist_v, tgt_v, neg_v, cat_v]),
            lengths=torch.cat([hist_l, tgt_l, neg_l, cat_l]).int(),
        )
        return {"features": kjt, "users": self.users[index], "seen_values": seen_v, "seen_lengths": seen_l}


class _EpochBatchSampler(DistributedBatchSampler):
    """:class:`DistributedBatchSampler` that yields ``(epoch, indices)``, so the dataset can seed by epoch."""

    def __iter__(self):
        return ((self.epoch, b) for b in self._batches())


def popularity_ranks(split: LeaveOneOut, num_items: int, stage: str = "test") -> torch.Tensor:
    """The popularity baseline: the 0-based rank of each evaluated user's held-out item when all items are ranked
    by their number of training interactions, with the same exclusions and tie-breaking as the models (items the
    user has seen before, and id 0, are not ranked; ties go to the lower item id).

    Args:
        split: a :func:`leave_one_out` split.
        num_items: rows of the item table.
        stage: ``"val"`` (history: train items) or ``"test"`` (history: train items and the validation item).

    Returns:
        ``(users evaluated,)`` long ranks (feed them to :class:`~lightning_rec.metrics.RankingMetrics`; :func:`~lightning_rec.metrics.target_rank`).

    Example::

        >>> s = leave_one_out(torch.tensor([1, 1, 1, 1, 2, 2, 2]), torch.tensor([1, 2, 4, 3, 1, 4, 5]), torch.arange(7))
        >>> popularity_ranks(s, num_items=6, stage="test").tolist()  # train counts 1: 2, 2: 1; user 2: 2, 3 before 5
        [0, 2]
    """
    if stage not in ("val", "test"):
        raise ValueError(f"popularity_ranks: stage must be 'val' or 'test', got {stage!r}. HINT: 'val' or 'test'.")
    counts = torch.bincount(split.train.values, minlength=num_items).double()
    rows = split.evaluated()
    train_rows = _rows(split.train)
    seen = _from_rows(
        [torch.cat([train_rows[i], split.val[i : i + 1]]) if stage == "test" else train_rows[i] for i in rows.tolist()]
    )
    target = (split.test if stage == "test" else split.val)[rows]
    scores = counts.expand(rows.numel(), num_items)
    return target_rank(scores, target, exclusion_mask(seen.values, seen.offsets.diff(), target, num_items))


def exclusion_mask(
    seen_values: torch.Tensor, seen_lengths: torch.Tensor, target: torch.Tensor, num_items: int
) -> torch.Tensor:
    """``(B, num_items)`` bool: the items each row does not rank (those it has seen, and id 0), never its target.

    Example::

        >>> exclusion_mask(torch.tensor([2, 1, 3]), torch.tensor([2, 1]), torch.tensor([3, 1]), 4).int().tolist()
        [[1, 1, 1, 0], [1, 0, 0, 1]]
    """
    b = seen_lengths.numel()
    mask = torch.zeros(b, num_items, dtype=torch.bool, device=target.device)
    rows = torch.repeat_interleave(torch.arange(b, device=target.device), seen_lengths.to(target.device))
    mask[rows, seen_values.to(target.device)] = True
    mask[:, 0] = True
    mask[torch.arange(b, device=target.device), target] = False
    return mask


class MovieLensSequenceDataModule(RecDataModule):
    """MovieLens-100K next-item prediction (see the module docstring): leave-one-out splits, one item table
    shared by the features ``history``, ``target``, ``negatives`` and ``catalog``.

    It publishes ``sparse_features`` as one :class:`~lightning_rec.data.SparseFeature` named ``item`` (the size of
    the shared item table; the CLI links it to the model) and ``num_dense_features = 0``.

    Args:
        data_dir: MovieLens-100K (either layout; fetched there if absent and ``download``).
        download: fetch the data when ``data_dir`` lacks it.
        max_len: the longest input sequence (the most recent items are kept).
        num_negatives: sampled negatives per training row (shared by its positions).
        batch_size, num_workers, seed: see :class:`~lightning_rec.data.base.RecDataModule` (``seed`` also seeds
            the negatives).

    Example::

        dm = MovieLensSequenceDataModule("data/ml-100k", max_len=50, batch_size=128)
        model = SequentialRecModule(dm.sparse_features, max_len=50)
        L.Trainer(strategy="recshard", devices=2, max_epochs=20).fit(model, dm)
    """

    def __init__(
        self,
        data_dir: str = "data/ml-100k",
        download: bool = True,
        max_len: int = 50,
        num_negatives: int = 100,
        batch_size: int = 128,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        if max_len < 1:
            raise ValueError(f"MovieLensSequenceDataModule: max_len must be >= 1, got {max_len}. HINT: e.g. 50.")
        if num_negatives < 1:
            raise ValueError(
                f"MovieLensSequenceDataModule: num_negatives must be >= 1, got {num_negatives}. HINT: e.g. 100."
            )
        self.data_dir = Path(data_dir)
        self.download = download
        self.max_len = max_len
        self.num_negatives = num_negatives
        self._split: LeaveOneOut | None = None
        self._num_items = 0
        self._datasets: dict[str, SequenceDataset] = {}

    def prepare_data(self) -> None:
        if self.download:
            prepare_movielens(self.data_dir)

    @property
    def leave_one_out(self) -> LeaveOneOut:
        """The split (loaded on first use)."""
        if self._split is None:
            self.prepare_data()
            it = load_interactions(self.data_dir)
            self._split, self._num_items = leave_one_out(it.user, it.item, it.timestamp), it.num_items
        return self._split

    @property
    def num_items(self) -> int:
        """Rows of the item table (the largest item id + 1)."""
        self.leave_one_out  # noqa: B018 (computed on first access; it sets _num_items)
        return self._num_items

    @property
    def sparse_features(self) -> list[SparseFeature]:
        return [SparseFeature("item", self.num_items, multi_hot=True)]

    @property
    def num_dense_features(self) -> int:
        return 0

    def setup(self, stage: str | None = None) -> None:
        if not self._datasets:
            self._datasets = self.datasets()

    def datasets(self) -> dict[str, SequenceDataset]:
        """The ``train``, ``val`` and ``test`` datasets (``predict`` is ``test``)."""
        s, n = self.leave_one_out, self.num_items
        train = _rows(s.train)
        trainable = [i for i, r in enumerate(train) if r.numel() >= 2]
        out = {
            "train": SequenceDataset(
                s.users[trainable],
                _from_rows([train[i][:-1] for i in trainable], self.max_len),
                _from_rows([train[i][1:] for i in trainable], self.max_len),
                None,
                n,
                self.num_negatives,
                self.seed,
            )
        }
        rows = s.evaluated().tolist()
        for stage, target in (("val", s.val), ("test", s.test)):
            seen = [torch.cat([train[i], s.val[i : i + 1]]) if stage == "test" else train[i] for i in rows]
            out[stage] = SequenceDataset(
                s.users[rows],
                _from_rows(seen, self.max_len),
                _from_rows([target[i : i + 1] for i in rows], 1),
                _from_rows(seen),
                n,
            )
        return out

    def split(self, name: str) -> SequenceDataset:
        self.setup()
        return self._datasets["test" if name == "predict" else name]

    def loader(self, dataset: Any, shuffle: bool, batch_size: int | None = None) -> DataLoader:
        """Like :meth:`RecDataModule.loader` (every rank the same number of batches, every row once), but the
        sampler yields ``(epoch, indices)``: training negatives depend on the epoch, not on the rank."""
        rank, world_size = self.rank_and_world_size
        sampler = _EpochBatchSampler(
            dataset, batch_size or self.batch_size, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=self.seed
        )
        return DataLoader(
            dataset,
            sampler=sampler,
            batch_size=None,
            collate_fn=identity,
            num_workers=self.num_workers,
            multiprocessing_context="spawn" if self.num_workers > 0 else None,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
        )


def popularity_baseline(data_dir: str = "data/ml-100k", ks: tuple[int, ...] = (10,)) -> dict[str, float]:
    """HR@k and NDCG@k of :func:`popularity_ranks` on the validation and test splits of MovieLens-100K.

    Example::

        >>> popularity_baseline("data/ml-100k")      # doctest: +SKIP
        {'val/hr@10': 0.0742, 'val/ndcg@10': 0.0345, 'test/hr@10': 0.0859, 'test/ndcg@10': 0.0449}
    """
    from lightning_rec.metrics import RankingMetrics

    dm = MovieLensSequenceDataModule(data_dir)
    out: dict[str, float] = {}
    for stage in ("val", "test"):
        metrics = RankingMetrics(ks, prefix=f"{stage}/", hit_name="hr")
        metrics.update(popularity_ranks(dm.leave_one_out, dm.num_items, stage))
        out.update({k: round(float(v), 4) for k, v in metrics.compute().items()})
    return out
