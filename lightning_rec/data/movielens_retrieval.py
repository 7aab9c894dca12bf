"""MovieLens-100K as a retrieval task: given a user and their history, find the next movie they will like.

Built on :func:`~lightning_rec.data.movielens.load_interactions`. A rating at or above ``positive_threshold``
(default 4 stars) is a *positive*; each user's positives are ordered by time (ties by file order).

**Leave-one-out split** (the usual protocol for sequential/retrieval models): for every user with at least
``min_positives`` (default 3) positives, the last positive is the test item, the second last the validation
item, the rest are training positives. Users with fewer positives only train. So validation and test hold
one query per evaluated user (942 of MovieLens-100K's 943 users have 3 or more positives).

Features (one :class:`~lightning_rec.data.SparseFeature` each; the model builds one table per feature except
for ``history`` and ``last_item``, which share one item table)::

    query      user_id, age, gender, occupation, zip      one id each, weight 1
               history    the user's last <= history_length positives before the target, time-ordered,
                          weighted (rating / 5, or recency: history_decay ** age, the newest has age 0)
               last_item  the newest of them (none for a user's first positive), weight 1
    candidate  item_id, genres (multi-hot)

Batches are dicts of ``KeyedJaggedTensor``s (the query's carries per-id weights: an ``is_weighted`` table
collection reads it)::

    train       {"query": KJT, "candidate": KJT,               one row per training positive (shuffled)
                 "candidate_log_q": (B,)}                       log of the candidate's share of the training
                                                                positives (its in-batch sampling probability)
    val / test  {"query": KJT, "target": (B,) item ids,
                 "candidate": KJT of every item id 0..num_items-1 (the catalogue, in id order),
                 "exclude_ids": ids, "exclude_lengths": (B,)}   per query: its training items (and, at test,
                                                                its validation item) and the unused id 0

Evaluation at validation uses the training positives as history; at test the validation item joins it (and is
excluded from the ranking, like the training items). Loaders come from
:meth:`~lightning_rec.data.base.RecDataModule.dataloader`: every rank runs the same number of batches and every row is
used exactly once, so ranking metrics summed over ranks equal the single-process ones.

**RecBole's general protocol** (``protocol="recbole"``, for numbers that stand beside RecBole's published BPR row):
every rating is a positive, each user's ratings are shuffled and cut 80/10/10 exactly as RecBole's
``Dataset.split_by_ratio`` with ``group_by: user`` does, the only features are ``user_id`` (query) and ``item_id``
(candidate), and evaluation ranks the whole catalogue for every user with interactions in the split, against all of
them (several positives per query), RecBole's history excluded; metrics are RecBole's
(:class:`~lightning_rec.metrics.TopKMetrics`). See :mod:`lightning_rec.data._retrieval_recbole` for each step and the
RecBole function it follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec._choices import check_choice
from lightning_rec.config import SparseFeature
from lightning_rec.data._retrieval_recbole import (
    RECBOLE_FEATURES,
    RECBOLE_SEED,
    RecBoleGeneralRows,
    RecBoleGeneralSplits,
    recbole_general_splits,
)
from lightning_rec.data.base import Jagged
from lightning_rec.data.movielens import Interactions, _MovieLensBase
from lightning_rec.metrics import RankingMetrics, target_rank

__all__ = [
    "CANDIDATE_FEATURES",
    "QUERY_FEATURES",
    "MovieLensRetrievalDataModule",
    "RetrievalRows",
    "RetrievalSplits",
    "popularity_baseline",
    "retrieval_splits",
]

_USER_FEATURES = ("user_id", "age", "gender", "occupation", "zip")
QUERY_FEATURES = _USER_FEATURES + ("history", "last_item")
CANDIDATE_FEATURES = ("item_id", "genres")
_HistoryWeights = Literal["rating", "recency"]
RetrievalProtocol = Literal["project", "recbole"]


def _jagged(rows: Sequence[Sequence[float]], dtype: torch.dtype) -> Jagged:
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return Jagged(torch.tensor([v for r in rows for v in r], dtype=dtype), offsets)


@dataclass(frozen=True)
class RetrievalRows:
    """One split's rows (queries) as columns; ``rows[index_tensor]`` builds a whole batch with tensor ops.

    Attributes:
        user: ``(N,)`` user ids.
        item: ``(N,)`` the positive item of each row (a training pair's candidate, an evaluation's target).
        history, history_weight: the user's earlier positives (ids, and their weights) per row.
        exclude: per row, items left out of the ranking (evaluation splits only; ``None`` for training).
        item_log_q: ``(num_items,)`` log of each item's share of the training positives (items never seen: as if
            seen once).
        interactions: the side features (users' and items') by id.

    Example::

        rows = dm.split("val")
        batch = rows[torch.arange(4)]        # {"query": KJT, "target": ..., "candidate": KJT, "exclude_*": ...}
    """

    user: torch.Tensor
    item: torch.Tensor
    history: Jagged
    history_weight: Jagged
    exclude: Jagged | None
    interactions: Interactions
    item_log_q: torch.Tensor

    def __len__(self) -> int:
        return self.user.numel()

    def query(self, index: torch.Tensor) -> KeyedJaggedTensor:
        """The weighted query KJT (user features, ``history``, ``last_item``) of rows ``index``."""
        users = self.user[index]
        n = index.numel()
        hist, hist_len = self.history.take(index)
        hist_w, _ = self.history_weight.take(index)
        last_len = (hist_len > 0).long()
        ends = torch.cumsum(hist_len, 0) - 1
        last = hist[ends[hist_len > 0]]
        feats = self.interactions.user_features
        values = [users] + [feats[name][users] for name in _USER_FEATURES[1:]] + [hist, last]
        ones = torch.ones(n, dtype=torch.float)
        weights = [ones] * len(_USER_FEATURES) + [hist_w, torch.ones(last.numel(), dtype=torch.float)]
        lengths = [torch.ones(n, dtype=torch.long)] * len(_USER_FEATURES) + [hist_len, last_len]
        return KeyedJaggedTensor.from_lengths_sync(
            keys=list(QUERY_FEATURES),
            values=torch.cat(values).long(),
            lengths=torch.cat(lengths).int(),
            weights=torch.cat(weights).float(),
        )

    def candidate(self, items: torch.Tensor) -> KeyedJaggedTensor:
        """The candidate KJT (``item_id``, ``genres``) of the item ids ``items``."""
        genres, genre_len = self.interactions.item_genres.take(items)
        return KeyedJaggedTensor.from_lengths_sync(
            keys=list(CANDIDATE_FEATURES),
            values=torch.cat([items, genres]).long(),
            lengths=torch.cat([torch.ones(items.numel(), dtype=torch.long), genre_len]).int(),
        )

    def __getitem__(self, index: torch.Tensor) -> dict[str, torch.Tensor | KeyedJaggedTensor]:
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        if self.exclude is None:
            items = self.item[index]
            return {
                "query": self.query(index),
                "candidate": self.candidate(items),
                "candidate_log_q": self.item_log_q[items],
            }
        excl, excl_len = self.exclude.take(index)
        return {
            "query": self.query(index),
            "target": self.item[index],
            "candidate": self.candidate(torch.arange(self.interactions.num_items)),
            "exclude_ids": excl,
            "exclude_lengths": excl_len,
        }


@dataclass(frozen=True)
class RetrievalSplits:
    """The leave-one-out split: ``train``, ``val`` and ``test`` :class:`RetrievalRows`, and the per-user sequences.

    Attributes:
        sequences: user id -> that user's positive item ids, time-ordered (all of them).
        num_items: rows of the item table (ids ``0..num_items-1``; 0 is never an item).

    Example::

        splits = retrieval_splits(load_interactions("data/ml-100k"))
        splits.test.item[:3], splits.sequences[1][-1]      # test targets; user 1's last positive is its target
    """

    train: RetrievalRows
    val: RetrievalRows
    test: RetrievalRows
    sequences: dict[int, list[int]]
    num_items: int


_LOO_DEFAULTS: dict[str, Any] = dict(
    positive_threshold=4.0, min_positives=3, history_length=20, history_weights="rating", history_decay=0.9
)


def _check_split_args(min_positives: int, history_length: int, history_weights: str, history_decay: float) -> None:
    if min_positives < 3:
        raise ValueError(
            f"retrieval_splits: min_positives must be >= 3 (one train, one val, one test), got {min_positives}. "
            "HINT: use 3 (the default)."
        )
    if history_length < 1:
        raise ValueError(f"retrieval_splits: history_length must be >= 1, got {history_length}. HINT: e.g. 20.")
    if history_weights not in ("rating", "recency"):
        raise ValueError(
            f"retrieval_splits: history_weights must be 'rating' or 'recency', got {history_weights!r}. HINT: 'rating'."
        )
    if not 0.0 < history_decay <= 1.0:
        raise ValueError(f"retrieval_splits: history_decay must be in (0, 1], got {history_decay}. HINT: e.g. 0.9.")


def retrieval_splits(
    interactions: Interactions,
    positive_threshold: float = 4.0,
    min_positives: int = 3,
    history_length: int = 20,
    history_weights: _HistoryWeights = "rating",
    history_decay: float = 0.9,
) -> RetrievalSplits:
    """Split the positives per user, by time: last -> test, second last -> validation, the rest -> training.

    Args:
        interactions: from :func:`~lightning_rec.data.movielens.load_interactions`.
        positive_threshold: ratings at or above it are positives.
        min_positives: users with fewer positives are not evaluated (all their positives train). At least 3.
        history_length: at most this many of the newest earlier positives form a query's history.
        history_weights: ``"rating"`` (stars / 5) or ``"recency"`` (``history_decay ** age``; the newest has age 0).
        history_decay: the base of recency weights, in ``(0, 1]``.

    Returns:
        the :class:`RetrievalSplits`. A training row is one training positive with the positives before it as
        history; an evaluation row is one user with its held-out item as target.

    Example::

        >>> splits = retrieval_splits(load_interactions("data/ml-100k"))                  # doctest: +SKIP
        >>> len(splits.train), len(splits.val), len(splits.test)                        # doctest: +SKIP
        (53491, 942, 942)
    """
    _check_split_args(min_positives, history_length, history_weights, history_decay)
    it = interactions
    positive = np.flatnonzero(it.rating.numpy() >= positive_threshold)
    user, ts = it.user.numpy()[positive], it.timestamp.numpy()[positive]
    order = positive[np.lexsort((positive, ts, user))]  # by user, then time, then file order
    sequences: dict[int, list[int]] = {}
    stars: dict[int, list[float]] = {}
    users, items, ratings = (column.numpy()[order].tolist() for column in (it.user, it.item, it.rating))
    for u, i, r in zip(users, items, ratings):
        sequences.setdefault(u, []).append(i)
        stars.setdefault(u, []).append(r)

    def weights_of(ratings: list[float]) -> list[float]:
        if history_weights == "rating":
            return [r / 5.0 for r in ratings]
        n = len(ratings)
        return [history_decay ** (n - 1 - j) for j in range(n)]

    train_counts = torch.zeros(it.num_items, dtype=torch.float64)
    for seq in sequences.values():
        n_train = len(seq) - 2 if len(seq) >= min_positives else len(seq)
        train_counts += torch.bincount(torch.tensor(seq[:n_train], dtype=torch.long), minlength=it.num_items).double()
    item_log_q = torch.log(train_counts.clamp(min=1.0) / train_counts.sum()).float()

    def rows(kind: str) -> RetrievalRows:
        users, items, hist, hist_w, excl = [], [], [], [], []
        for u, seq in sequences.items():
            evaluated = len(seq) >= min_positives
            n_train = len(seq) - 2 if evaluated else len(seq)
            if kind == "train":
                for t in range(n_train):
                    lo = max(0, t - history_length)
                    users.append(u)
                    items.append(seq[t])
                    hist.append(seq[lo:t])
                    hist_w.append(weights_of(stars[u][lo:t]))
            elif evaluated:
                t = n_train if kind == "val" else n_train + 1
                lo = max(0, t - history_length)
                users.append(u)
                items.append(seq[t])
                hist.append(seq[lo:t])
                hist_w.append(weights_of(stars[u][lo:t]))
                excl.append([0] + seq[:t])
        return RetrievalRows(
            user=torch.tensor(users, dtype=torch.long),
            item=torch.tensor(items, dtype=torch.long),
            history=_jagged(hist, torch.long),
            history_weight=_jagged(hist_w, torch.float),
            exclude=_jagged(excl, torch.long) if kind != "train" else None,
            interactions=it,
            item_log_q=item_log_q,
        )

    return RetrievalSplits(rows("train"), rows("val"), rows("test"), sequences, it.num_items)


def popularity_baseline(splits: RetrievalSplits, split: str = "test", ks: Sequence[int] = (10, 50)) -> dict[str, float]:
    """Rank every item by its number of training positives (ties: lower id first), with the same exclusions as the
    model's evaluation, and report recall@k and NDCG@k on ``split``.

    Example::

        >>> dm = MovieLensRetrievalDataModule("data/ml-100k")                           # doctest: +SKIP
        >>> popularity_baseline(dm.splits, "test")["test/recall@10"]                      # doctest: +SKIP
        0.0807...
    """
    if split not in ("val", "test"):
        raise ValueError(f"popularity_baseline: split must be 'val' or 'test', got {split!r}.")
    rows: RetrievalRows = getattr(splits, split)
    counts = torch.bincount(splits.train.item, minlength=splits.num_items).double()
    metrics = RankingMetrics(ks, prefix=f"{split}/")
    assert rows.exclude is not None
    for index in torch.arange(len(rows)).split(1024):
        excl, excl_len = rows.exclude.take(index)
        mask = torch.zeros(index.numel(), splits.num_items, dtype=torch.bool)
        mask[torch.repeat_interleave(torch.arange(index.numel()), excl_len), excl] = True
        scores = counts.expand(index.numel(), -1)
        metrics.update(target_rank(scores, rows.item[index], exclude=mask))
    return {k: float(v) for k, v in metrics.compute().items()}


class MovieLensRetrievalDataModule(_MovieLensBase):
    """MovieLens-100K positives (rating >= 4) for retrieval, leave-one-out split (see the module docstring); or, with
    ``protocol="recbole"``, RecBole's general-recommendation protocol (every rating, per-user random 80/10/10, full
    ranking against each user's several positives; :mod:`lightning_rec.data._retrieval_recbole`).

    Publishes ``sparse_features`` (the CLI links them into the model): user features, ``history`` and ``last_item``
    (item ids: one shared table), ``item_id`` and ``genres``; under ``"recbole"`` only ``user_id`` and ``item_id``
    (RecBole's quick-start loads nothing else). ``num_dense_features`` is 0.

    Args:
        data_dir: a directory with MovieLens-100K (either layout); fetched there if absent and ``download``.
        download: fetch the data when ``data_dir`` lacks it.
        positive_threshold, min_positives, history_length, history_weights, history_decay: see
            :func:`retrieval_splits`.
        eval_batch_size: queries per evaluation batch (each is ranked against the whole catalogue); default
            ``batch_size``.
        batch_size, num_workers, seed: see :class:`~lightning_rec.data.base.RecDataModule`.
        protocol: ``"project"`` (the leave-one-out split above, the default) or ``"recbole"`` (RecBole's general
            protocol; the leave-one-out arguments must then keep their defaults).
        split_seed: ``"recbole"`` only: the seed of the shuffle before the per-user split; ``None``: 2020, RecBole's
            default ``seed``, which draws the very split of RecBole's published run.

    Example::

        dm = MovieLensRetrievalDataModule("data/ml-100k", batch_size=512)
        model = TwoTowerModule(dm.sparse_features)
        L.Trainer(strategy="recshard", devices=2, max_epochs=5).fit(model, dm)
        popularity_baseline(dm.splits, "test")      # what the model must beat

        recbole = MovieLensRetrievalDataModule("data/ml-100k", protocol="recbole")
        [f.name for f in recbole.sparse_features]   # ['user_id', 'item_id']: matrix factorisation
    """

    def __init__(
        self,
        data_dir: str = "data/ml-100k",
        download: bool = True,
        positive_threshold: float = 4.0,
        min_positives: int = 3,
        history_length: int = 20,
        history_weights: _HistoryWeights = "rating",
        history_decay: float = 0.9,
        eval_batch_size: int | None = None,
        batch_size: int = 512,
        num_workers: int = 0,
        seed: int = 0,
        protocol: RetrievalProtocol = "project",
        split_seed: int | None = None,
    ) -> None:
        name = type(self).__name__
        check_choice(name, "protocol", protocol, RetrievalProtocol)
        loo = dict(
            positive_threshold=positive_threshold,
            min_positives=min_positives,
            history_length=history_length,
            history_weights=history_weights,
            history_decay=history_decay,
        )
        if protocol == "recbole":
            changed = {k: v for k, v in loo.items() if v != _LOO_DEFAULTS[k]}
            if changed:
                raise ValueError(
                    f"{name}: protocol='recbole' uses every rating and no history, so {changed} has no effect. "
                    "HINT: leave those arguments out, or use protocol='project'."
                )
        elif split_seed is not None:
            raise ValueError(
                f"{name}: split_seed={split_seed} seeds protocol='recbole''s random split; protocol='project' splits "
                "by time. HINT: leave split_seed out, or set protocol='recbole'."
            )
        super().__init__(data_dir, download, batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.protocol = protocol
        self.split_seed = RECBOLE_SEED if split_seed is None else split_seed
        self.split_args: dict[str, Any] = dict(
            positive_threshold=positive_threshold,
            min_positives=min_positives,
            history_length=history_length,
            history_weights=history_weights,
            history_decay=history_decay,
        )
        _check_split_args(min_positives, history_length, history_weights, history_decay)
        self.eval_batch_size = eval_batch_size or batch_size
        self._splits: RetrievalSplits | RecBoleGeneralSplits | None = None

    @property
    def splits(self) -> Any:
        """The split, built on first use: :class:`RetrievalSplits` (leave-one-out) or, under ``"recbole"``,
        :class:`~lightning_rec.data._retrieval_recbole.RecBoleGeneralSplits`."""
        if self._splits is None:
            if self.protocol == "recbole":
                self._splits = recbole_general_splits(self.interactions, self.split_seed)
            else:
                self._splits = retrieval_splits(self.interactions, **self.split_args)
        return self._splits

    @property
    def sparse_features(self) -> list[SparseFeature]:
        it = self.interactions
        sizes = {f.name: f for f in it.features}
        if self.protocol == "recbole":
            return [sizes[name] for name in RECBOLE_FEATURES]
        return [
            *(sizes[name] for name in _USER_FEATURES),
            SparseFeature("history", it.num_items, multi_hot=True),
            SparseFeature("last_item", it.num_items, multi_hot=True),
            sizes["item_id"],
            sizes["genres"],
        ]

    @property
    def num_dense_features(self) -> int:
        return 0

    def split(self, name: str) -> RetrievalRows | RecBoleGeneralRows:
        """The rows of split ``name`` (the split is built on first use); ``predict`` runs over the test queries."""
        if name not in ("train", "val", "test", "predict"):
            raise ValueError(f"{type(self).__name__}: unknown split {name!r}. HINT: train, val, test or predict.")
        return getattr(self.splits, "test" if name == "predict" else name)
