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

    features      KeyedJaggedTensor, keys SEQUENCE_FEATURES (lightning_rec.config), all read by ONE item
                  table (EmbeddingCollection):
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

``protocol="recbole"`` is RecBole's sequential quick-start instead (``docs/source/get_started/started/
sequential.rst``; every rule cited in :mod:`lightning_rec.data._sequential_recbole`): RecBole's per-user order,
every prefix a training example (history cut to ``max_len``, RecBole's ``MAX_ITEM_LIST_LENGTH``), leave-one-out
over those examples, and evaluation rows that exclude nothing but id 0 (``seen`` is empty: RecBole ranks the items a
sequential user has already seen). Training rows then pack the examples (``train_stride``) and carry the catalog
(for a full-softmax loss) and ``train_from`` ``(B,)``: the first position of each row that is a training example.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec._choices import check_choice
from lightning_rec.config import SEQUENCE_FEATURES, SparseFeature
from lightning_rec.data._sequential_recbole import UserSequences, prefix_examples, prefix_windows, user_sequences
from lightning_rec.data.base import Jagged
from lightning_rec.data.movielens import _MovieLensBase
from lightning_rec.metrics import RankingMetrics, exclusion_mask, target_rank

__all__ = [
    "MovieLensSequenceDataModule",
    "SequenceProtocol",
    "SequenceDataset",
    "SequenceSplits",
    "popularity_baseline",
    "popularity_ranks",
    "sequence_splits",
]


SequenceProtocol = Literal["project", "recbole"]
"""The protocol of :class:`MovieLensSequenceDataModule`: this project's (the default) or RecBole's sequential
quick-start."""


def _jagged(values: torch.Tensor, lengths: torch.Tensor) -> Jagged:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return Jagged(values.long(), offsets)


def _rows(j: Jagged) -> list[torch.Tensor]:
    return [j.values[j.offsets[i] : j.offsets[i + 1]] for i in range(len(j))]


@dataclass(frozen=True)
class SequenceSplits:
    """Each user's time-ordered items, split leave-one-out.

    Attributes:
        users: ``(U,)`` the user ids, ascending (every user with at least one interaction).
        train: per user, the training items in time order (all but the last two; all for users with < 3 items).
        val: ``(U,)`` the second-last item, or -1 for users with < 3 items.
        test: ``(U,)`` the last item, or -1 for users with < 3 items.
        num_items: rows of the item table (ids ``0..num_items-1``; the catalog ranked at evaluation).

    Example::

        >>> s = sequence_splits(torch.tensor([1, 1, 1, 1]), torch.tensor([5, 6, 7, 8]), torch.tensor([3, 1, 2, 2]), 9)
        >>> s.train.values.tolist(), s.val.tolist(), s.test.tolist()   # times 1, 2, 2 (file order), 3
        ([6, 7], [8], [5])
    """

    users: torch.Tensor
    train: Jagged
    val: torch.Tensor
    test: torch.Tensor
    num_items: int

    def evaluated(self) -> torch.Tensor:
        """Indices (into :attr:`users`) of the users with a validation and a test item."""
        return (self.test >= 0).nonzero().squeeze(1)


def sequence_splits(user: torch.Tensor, item: torch.Tensor, timestamp: torch.Tensor, num_items: int) -> SequenceSplits:
    """Order each user's interactions by time (ties: the order given) and hold out the last two (leave-one-out).

    Args:
        user, item, timestamp: ``(N,)`` one interaction each, e.g. :class:`~lightning_rec.data.movielens.Interactions`.
        num_items: rows of the item table (every item id is below it).

    Returns:
        the :class:`SequenceSplits`.

    Example::

        >>> s = sequence_splits(torch.tensor([2, 1, 2, 2]), torch.tensor([9, 4, 8, 7]), torch.tensor([0, 5, 1, 2]), 10)
        >>> s.users.tolist(), s.train.values.tolist(), s.val.tolist(), s.test.tolist()
        ([1, 2], [4, 9], [-1, 8], [-1, 7])
    """
    if not (user.shape == item.shape == timestamp.shape) or user.dim() != 1:
        raise ValueError(
            f"sequence_splits: user, item and timestamp must be 1-D of one length, got {tuple(user.shape)}, "
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
    return SequenceSplits(users, _jagged(items[keep], train_len), val, test, num_items)


def _from_rows(rows: list[torch.Tensor], max_len: int | None = None) -> Jagged:
    """The rows as a :class:`Jagged`, each cut to its last ``max_len`` items (all when ``None``)."""
    rows = [r[-max_len:] for r in rows] if max_len is not None else rows
    values = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    return _jagged(values, torch.tensor([r.numel() for r in rows], dtype=torch.long))


class SequenceDataset:
    """One split's rows (see the module docstring), indexed a batch at a time: ``dataset[indices]`` or
    ``dataset[(epoch, indices)]`` (training: the epoch picks the negatives) returns a batch dict.

    Its loaders yield ``(epoch, indices)`` (``indexed_by_epoch``), so the negatives depend on the epoch and the row,
    not on the rank or the DataLoader worker.

    Args:
        users: ``(R,)`` user id of each row.
        history: the input sequence of each row.
        target: train: the next item of each input position (same lengths as ``history``); eval: one item per row.
        seen: eval: the items excluded from each row's ranking; ``None`` in training.
        num_items: rows of the item table (the catalog ranked at evaluation is ``0..num_items-1``).
        num_negatives: sampled negatives per training row (0 for evaluation).
        seed: seeds the negatives (with the epoch).
        train_from: ``(R,)`` the first position of each training row that is a training example (earlier ones are
            context); ``None``: every position. Batches then carry it as ``train_from``.
        catalog: put every item id on each batch's first row (feature ``catalog``); ``None``: in evaluation rows
            only (``seen`` given). A full-softmax loss needs it in training rows too.

    Example::

        >>> ds = SequenceDataset(torch.tensor([7]), Jagged.from_lists([[1, 2]]), Jagged.from_lists([[2, 3]]), None,
        ...                      num_items=5, num_negatives=2)
        >>> b = ds[(0, torch.tensor([0]))]
        >>> b["features"].keys(), b["features"].lengths().tolist()
        (['history', 'target', 'negatives', 'catalog'], [2, 2, 2, 0])
    """

    indexed_by_epoch = True

    def __init__(
        self,
        users: torch.Tensor,
        history: Jagged,
        target: Jagged,
        seen: Jagged | None,
        num_items: int,
        num_negatives: int = 0,
        seed: int = 0,
        train_from: torch.Tensor | None = None,
        catalog: bool | None = None,
    ) -> None:
        if (
            not (len(history) == len(target) == users.numel())
            or (seen is not None and len(seen) != users.numel())
            or (train_from is not None and train_from.shape != users.shape)
        ):
            raise ValueError(
                f"SequenceDataset: users ({users.numel()}), history ({len(history)}), target ({len(target)})"
                f"{'' if seen is None else f' and seen ({len(seen)})'} must have one row per user. HINT: build them "
                "from one sequence_splits() split."
            )
        if num_negatives < 0 or (num_negatives and num_items < 2):
            raise ValueError(
                f"SequenceDataset: num_negatives must be >= 0 (with >= 2 items), got {num_negatives} with {num_items} "
                "items. HINT: 0 for evaluation rows, e.g. 100 for training rows."
            )
        self.users, self.history, self.target, self.seen = users.long(), history, target, seen
        self.num_items, self.num_negatives, self.seed = num_items, num_negatives, seed
        self.train_from = train_from
        self.catalog = seen is not None if catalog is None else catalog
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
        cat_v = torch.zeros(0, dtype=torch.long)
        if self.catalog:  # the whole catalog, once per batch
            cat_v = torch.arange(self.num_items)
            cat_l[0] = self.num_items
        if self.seen is not None:
            seen_v, seen_l = self.seen.take(index)
        else:
            seen_v, seen_l = torch.zeros(0, dtype=torch.long), torch.zeros(b, dtype=torch.long)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=list(SEQUENCE_FEATURES),
            values=torch.cat([hist_v, tgt_v, neg_v, cat_v]),
            lengths=torch.cat([hist_l, tgt_l, neg_l, cat_l]).int(),
        )
        batch = {"features": kjt, "users": self.users[index], "seen_values": seen_v, "seen_lengths": seen_l}
        if self.train_from is not None:
            batch["train_from"] = self.train_from[index]
        return batch


def popularity_ranks(splits: SequenceSplits, split: str = "test") -> torch.Tensor:
    """The popularity baseline: the 0-based rank of each evaluated user's held-out item when all items are ranked
    by their number of training interactions, with the same exclusions and tie-breaking as the models (items the
    user has seen before, and id 0, are not ranked; ties go to the lower item id).

    Args:
        splits: a :func:`sequence_splits` split.
        split: ``"val"`` (history: train items) or ``"test"`` (history: train items and the validation item).

    Returns:
        ``(users evaluated,)`` long ranks (feed them to :class:`~lightning_rec.metrics.RankingMetrics`; :func:`~lightning_rec.metrics.target_rank`).

    Example::

        >>> s = sequence_splits(torch.tensor([1, 1, 1, 1, 2, 2, 2]), torch.tensor([1, 2, 4, 3, 1, 4, 5]), torch.arange(7), 6)
        >>> popularity_ranks(s, "test").tolist()  # train counts 1: 2, 2: 1; user 2: 2, 3 before 5
        [0, 2]
    """
    if split not in ("val", "test"):
        raise ValueError(f"popularity_ranks: split must be 'val' or 'test', got {split!r}. HINT: 'val' or 'test'.")
    num_items = splits.num_items
    counts = torch.bincount(splits.train.values, minlength=num_items).double()
    rows = splits.evaluated()
    train_rows = _rows(splits.train)
    seen = _from_rows(
        [torch.cat([train_rows[i], splits.val[i : i + 1]]) if split == "test" else train_rows[i] for i in rows.tolist()]
    )
    target = (splits.test if split == "test" else splits.val)[rows]
    scores = counts.expand(rows.numel(), num_items)
    return target_rank(scores, target, exclusion_mask(seen.values, seen.offsets.diff(), target, num_items))


def popularity_baseline(splits: SequenceSplits, split: str = "test", ks: Sequence[int] = (10, 50)) -> dict[str, float]:
    """HR@k and NDCG@k of :func:`popularity_ranks` on ``split`` (``"val"`` or ``"test"``).

    Example::

        >>> dm = MovieLensSequenceDataModule("data/ml-100k")                            # doctest: +SKIP
        >>> popularity_baseline(dm.splits, "test", ks=(10,))                              # doctest: +SKIP
        {'test/hr@10': 0.0859..., 'test/ndcg@10': 0.0449...}
    """
    metrics = RankingMetrics(ks, prefix=f"{split}/", hit_name="hr")
    metrics.update(popularity_ranks(splits, split))
    return {k: float(v) for k, v in metrics.compute().items()}


class MovieLensSequenceDataModule(_MovieLensBase):
    """MovieLens-100K next-item prediction (see the module docstring): leave-one-out splits, one item table
    shared by the features ``history``, ``target``, ``negatives`` and ``catalog``.

    It publishes ``sparse_features`` as one :class:`~lightning_rec.data.SparseFeature` named ``item`` (the size of
    the shared item table; the CLI links it to the model) and ``num_dense_features = 0``.

    ``protocol="recbole"``: RecBole's sequential quick-start (module docstring;
    :mod:`lightning_rec.data._sequential_recbole` cites each RecBole function): validation and test rows are
    RecBole's held-out examples (history: the ``max_len`` most recent items before the target), ranked against every
    item but id 0; training rows pack RecBole's training examples (every prefix), ``train_stride`` apart
    (``1``: exactly RecBole's examples; larger: each target once per epoch from at least ``max_len - train_stride +
    1`` recent items, ~``1/train_stride`` of the cost) and carry the catalog for a full-softmax loss.

    Args:
        data_dir: MovieLens-100K (either layout; fetched there if absent and ``download``).
        download: fetch the data when ``data_dir`` lacks it.
        max_len: the longest input sequence (the most recent items are kept); RecBole's ``MAX_ITEM_LIST_LENGTH``.
        num_negatives: sampled negatives per training row (shared by its positions); may be 0 under
            ``protocol="recbole"`` (RecBole's ``train_neg_sample_args: ~``: the loss ranks the whole catalog).
        batch_size, num_workers, seed: see :class:`~lightning_rec.data.base.RecDataModule` (``seed`` also seeds
            the negatives).
        protocol: ``"project"`` (the default) or ``"recbole"`` (above).
        train_stride: ``protocol="recbole"``: the items between the starts of a user's training rows.

    Example::

        dm = MovieLensSequenceDataModule("data/ml-100k", max_len=50, batch_size=128)
        model = SequentialRecModule(dm.sparse_features, max_len=50)
        L.Trainer(strategy="recshard", devices=2, max_epochs=20).fit(model, dm)
        popularity_baseline(dm.splits, "test")      # what the model must beat

        recbole = MovieLensSequenceDataModule("data/ml-100k", protocol="recbole", num_negatives=0, train_stride=25)
        gru = SequentialRecModule(recbole.sparse_features, encoder="gru", loss="full_softmax", metrics="recbole")
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
        protocol: SequenceProtocol = "project",
        train_stride: int = 1,
    ) -> None:
        check_choice("MovieLensSequenceDataModule", "protocol", protocol, SequenceProtocol)
        if max_len < 1:
            raise ValueError(f"MovieLensSequenceDataModule: max_len must be >= 1, got {max_len}. HINT: e.g. 50.")
        if num_negatives < (0 if protocol == "recbole" else 1):
            raise ValueError(
                f"MovieLensSequenceDataModule: num_negatives must be >= {0 if protocol == 'recbole' else 1}, got "
                f"{num_negatives}. HINT: e.g. 100{' (or 0 for a full-softmax loss)' if protocol == 'recbole' else ''}."
            )
        if not 1 <= train_stride <= max_len:
            raise ValueError(
                f"MovieLensSequenceDataModule: train_stride must be in [1, max_len={max_len}], got {train_stride}. "
                "HINT: 1 packs exactly RecBole's every-prefix examples; larger strides are cheaper."
            )
        super().__init__(data_dir, download, batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.max_len = max_len
        self.num_negatives = num_negatives
        self.protocol = protocol
        self.train_stride = train_stride
        self._splits: SequenceSplits | None = None
        self._sequences: UserSequences | None = None
        self._datasets: dict[str, SequenceDataset] = {}

    @property
    def splits(self) -> SequenceSplits:
        """The leave-one-out split (built on first use)."""
        if self._splits is None:
            it = self.interactions
            self._splits = sequence_splits(it.user, it.item, it.timestamp, it.num_items)
        return self._splits

    @property
    def sequences(self) -> UserSequences:
        """Every user's items in RecBole's order (``protocol="recbole"``'s source; built on first use)."""
        if self._sequences is None:
            it = self.interactions
            self._sequences = user_sequences(it.user, it.item, it.timestamp)
        return self._sequences

    @property
    def num_items(self) -> int:
        """Rows of the item table (the largest item id + 1)."""
        return self.interactions.num_items

    @property
    def sparse_features(self) -> list[SparseFeature]:
        return [SparseFeature("item", self.num_items, multi_hot=True)]

    @property
    def num_dense_features(self) -> int:
        return 0

    def split(self, name: str) -> SequenceDataset:
        """The rows of split ``name`` (built on first use); ``predict`` runs over the test rows."""
        if not self._datasets:
            self._datasets = self._build()
        return self._datasets["test" if name == "predict" else name]

    def _build(self) -> dict[str, SequenceDataset]:
        """The ``train``, ``val`` and ``test`` datasets."""
        if self.protocol == "recbole":
            return self._build_recbole()
        s, n = self.splits, self.num_items
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

    def _build_recbole(self) -> dict[str, SequenceDataset]:
        """``protocol="recbole"``'s datasets (see the class docstring)."""
        seqs, n = self.sequences, self.num_items
        w = prefix_windows(seqs, self.max_len, self.train_stride)
        out = {
            "train": SequenceDataset(
                w.users, w.history, w.target, None, n, self.num_negatives, self.seed, w.train_from, catalog=True
            )
        }
        for stage in ("val", "test"):
            ex = prefix_examples(seqs, stage, self.max_len)
            nothing_seen = _jagged(torch.zeros(0, dtype=torch.long), torch.zeros(ex.users.numel(), dtype=torch.long))
            target = _jagged(ex.target, torch.ones_like(ex.target))
            out[stage] = SequenceDataset(ex.users, ex.history, target, nothing_seen, n)
        return out
