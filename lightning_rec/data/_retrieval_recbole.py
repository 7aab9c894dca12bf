"""RecBole's general-recommendation protocol on MovieLens-100K, for :class:`MovieLensRetrievalDataModule`
(``protocol="recbole"``): the split and the full-ranking rules of RecBole 1.2.1's BPR quick-start
(``docs/source/get_started/started/general.rst`` in RUCAIBox/RecBole), written so each step can be checked against
RecBole's code.

* **Interactions**: every rating is a positive (the quick-start loads ``user_id`` and ``item_id`` only: no
  ``threshold``, no ``*_inter_num_interval`` filter), 100,000 of them.
* **Order** (``eval_args.order: RO``): RecBole's ``Dataset.build`` calls ``Dataset.shuffle``, i.e.
  ``Interaction.shuffle``: ``torch.randperm`` of the rows in file order. Here the permutation comes from a generator
  seeded with ``split_seed``; RecBole draws it from the global generator right after ``init_seed(seed)``, so
  ``split_seed=2020`` (RecBole's default ``seed``, the published run's) draws RecBole's own split.
* **Split** (``split: {RS: [0.8, 0.1, 0.1]}``, ``group_by: user``): ``Dataset.split_by_ratio`` groups the shuffled
  rows by user (``Dataset._grouped_index``: each user's rows in shuffled order) and cuts every group at
  ``Dataset._calcu_split_ids(len(group), ratios)`` (:func:`~lightning_rec.data.movielens.recbole_split_ids`): a user
  with 20 ratings has 16 / 2 / 2, one with 25 has 21 / 2 / 2 (the rounding-down parts are the last two).
* **Evaluation** (``mode: full``, ``FullSortEvalDataLoader``): one query per user with at least one interaction in
  the split; its positives are all its items there (a set). Every item is ranked except, as RecBole's
  ``Trainer._full_sort_batch_eval`` sets their scores to ``-inf``, id 0 (padding) and the user's *history*:
  ``FullSortEvalDataLoader._set_user_property`` takes ``used_ids - positives``, where the ``Sampler``'s
  ``used_ids`` are the items of the earlier phases and this one (validation: train + validation items; test: train
  + validation + test items). So validation excludes the training items, test the training and validation items
  (minus the split's own positives, which matters only for a user who rated an item twice).
* **Metrics**: :class:`~lightning_rec.metrics.TopKMetrics` over the top-``k`` list of ``torch.topk``
  (:func:`~lightning_rec.metrics.topk_hits`, RecBole's ``Collector.eval_batch_collect``).

Batches::

    train       {"query": KJT user_id (weights 1), "candidate": KJT item_id,    one row per training interaction
                 "candidate_log_q": (B,)}                                         (shuffled each epoch)
    val / test  {"query": KJT user_id, "candidate": KJT item_id 0..num_items-1,  one row per evaluated user
                 "positive_ids", "positive_lengths": (B,),                         its items in the split
                 "exclude_ids", "exclude_lengths": (B,)}                           id 0 and its history (above)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec.data.base import Jagged
from lightning_rec.data.movielens import Interactions, recbole_split_ids

__all__ = ["RECBOLE_FEATURES", "RECBOLE_RATIOS", "RecBoleGeneralRows", "RecBoleGeneralSplits", "recbole_general_splits"]

RECBOLE_FEATURES = ("user_id", "item_id")
RECBOLE_RATIOS = (0.8, 0.1, 0.1)
RECBOLE_SEED = 2020  # RecBole's default `seed` (properties/overall.yaml): the published run's split


@dataclass(frozen=True)
class RecBoleGeneralRows:
    """One split's rows: training interactions, or evaluated users with their positives and exclusions.

    Attributes:
        user: ``(N,)`` user ids (a training row's user, an evaluated user).
        item: ``(N,)`` a training row's item; empty for an evaluation split.
        positives: per evaluated user, its items in the split (sorted, distinct); ``None`` for training.
        exclude: per evaluated user, id 0 and its history (see the module docstring); ``None`` for training.
        num_items: rows of the item table (the catalogue is ids ``0..num_items-1``).
        item_log_q: ``(num_items,)`` log of each item's share of the training interactions (unseen: as if once).

    Example::

        rows = recbole_general_splits(load_interactions("data/ml-100k")).test
        batch = rows[torch.arange(8)]      # {"query", "candidate", "positive_ids", "positive_lengths", "exclude_*"}
    """

    user: torch.Tensor
    item: torch.Tensor
    positives: Jagged | None
    exclude: Jagged | None
    num_items: int
    item_log_q: torch.Tensor

    def __len__(self) -> int:
        return self.user.numel()

    def query(self, index: torch.Tensor) -> KeyedJaggedTensor:
        """The query KJT (``user_id``, weight 1: the query tower's collection is weighted) of rows ``index``."""
        users = self.user[torch.as_tensor(index, dtype=torch.long).reshape(-1)]
        ones = torch.ones(users.numel(), dtype=torch.int)
        return KeyedJaggedTensor.from_lengths_sync(["user_id"], users, ones, weights=torch.ones(users.numel()))

    def candidate(self, items: torch.Tensor) -> KeyedJaggedTensor:
        """The candidate KJT (``item_id``) of the item ids ``items``."""
        items = torch.as_tensor(items, dtype=torch.long).reshape(-1)
        return KeyedJaggedTensor.from_lengths_sync(["item_id"], items, torch.ones(items.numel(), dtype=torch.int))

    def __getitem__(self, index: torch.Tensor) -> dict[str, torch.Tensor | KeyedJaggedTensor]:
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        if self.positives is None or self.exclude is None:
            items = self.item[index]
            return {
                "query": self.query(index),
                "candidate": self.candidate(items),
                "candidate_log_q": self.item_log_q[items],
            }
        pos, pos_len = self.positives.take(index)
        excl, excl_len = self.exclude.take(index)
        return {
            "query": self.query(index),
            "candidate": self.candidate(torch.arange(self.num_items)),
            "positive_ids": pos,
            "positive_lengths": pos_len,
            "exclude_ids": excl,
            "exclude_lengths": excl_len,
        }


@dataclass(frozen=True)
class RecBoleGeneralSplits:
    """RecBole's per-user 80/10/10 split: ``train``, ``val``, ``test`` :class:`RecBoleGeneralRows`.

    Attributes:
        parts: user id -> its items in train, validation and test (each in RecBole's shuffled order).
    """

    train: RecBoleGeneralRows
    val: RecBoleGeneralRows
    test: RecBoleGeneralRows
    parts: dict[int, tuple[list[int], list[int], list[int]]]


def recbole_general_splits(
    interactions: Interactions, split_seed: int = RECBOLE_SEED, ratios: Sequence[float] = RECBOLE_RATIOS
) -> RecBoleGeneralSplits:
    """RecBole's ``Dataset.build`` for ``order: RO``, ``split: {RS: ratios}``, ``group_by: user`` (see the module
    docstring), and the full-ranking exclusions of its ``FullSortEvalDataLoader``.

    Args:
        interactions: from :func:`~lightning_rec.data.movielens.load_interactions` (every rating is used).
        split_seed: seed of the shuffle (``torch.randperm`` of the rows in file order); 2020 is RecBole's.
        ratios: the parts' shares (normalised, as ``Dataset.split_by_ratio`` does).

    Example::

        >>> splits = recbole_general_splits(load_interactions("data/ml-100k"))            # doctest: +SKIP
        >>> len(splits.train), len(splits.val), len(splits.test)                           # doctest: +SKIP
        (80666, 943, 943)
    """
    num_rows = interactions.user.numel()
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(split_seed)).numpy()
    users = interactions.user.numpy()[order]
    items = interactions.item.numpy()[order]
    # Dataset._grouped_index: each user's rows, in shuffled order (a stable sort by user keeps that order)
    by_user = np.argsort(users, kind="stable")
    starts = np.flatnonzero(np.r_[True, users[by_user][1:] != users[by_user][:-1]])
    ends = np.r_[starts[1:], num_rows]
    parts: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for start, end in zip(starts.tolist(), ends.tolist()):
        group = items[by_user[start:end]].tolist()
        first, second = recbole_split_ids(len(group), ratios)
        parts[int(users[by_user[start]])] = (group[:first], group[first:second], group[second:])

    num_items = interactions.num_items
    train_user = torch.tensor([u for u, (tr, _, _) in parts.items() for _ in tr], dtype=torch.long)
    train_item = torch.tensor([i for tr, _, _ in parts.values() for i in tr], dtype=torch.long)
    counts = torch.bincount(train_item, minlength=num_items).double()
    item_log_q = torch.log(counts.clamp(min=1.0) / counts.sum()).float()

    def evaluated(phase: int) -> RecBoleGeneralRows:
        eval_users, positives, exclude = [], [], []
        for user in sorted(parts):  # FullSortEvalDataLoader sorts by user
            positive = set(parts[user][phase])
            if not positive:
                continue  # a user without interactions in the split is not evaluated
            used = set().union(*parts[user][: phase + 1])  # Sampler.used_ids of this phase
            eval_users.append(user)
            positives.append(sorted(positive))
            exclude.append([0, *sorted(used - positive - {0})])
        return RecBoleGeneralRows(
            user=torch.tensor(eval_users, dtype=torch.long),
            item=torch.zeros(0, dtype=torch.long),
            positives=Jagged.from_lists(positives),
            exclude=Jagged.from_lists(exclude),
            num_items=num_items,
            item_log_q=item_log_q,
        )

    train = RecBoleGeneralRows(train_user, train_item, None, None, num_items, item_log_q)
    return RecBoleGeneralSplits(train, evaluated(1), evaluated(2), parts)
