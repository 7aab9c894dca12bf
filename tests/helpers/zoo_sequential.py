"""The zoo case of SASRec (:class:`lightning_rec.models.sequential.SequentialRecModule`) on MovieLens-100K sequences.

One item table is shared by the four features of every batch (history, target, negatives, catalog); with 2
processes it is split row-wise over both ranks (as the shipped config splits it), with 1 it is table-wise
(resharding changes the type too).
Training batches are whole users' sequences with their sampled negatives; the loss is the mean over rows of each
row's mean over positions, so the mean of the ranks' losses on equal halves is the whole batch's. The held-out
batch is an evaluation batch (test split): its ``catalog`` feature sits on the batch's first row, so a rank's share
is rebuilt from the dataset for its rows (a plain row slice would leave rank 1 without a catalog). Predictions:
each user's 0-based rank of the held-out item and its score.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from torch import nn

from lightning_rec.config import EmbeddingOptimizer, SparseFeature
from lightning_rec.data.movielens_sequential import MovieLensSequenceDataModule, SequenceDataset
from lightning_rec.models.sequential import SequentialRecModule, catalog_scores
from tests.helpers.data import movielens_dir
from tests.helpers.zoo import ZooCase, share_rows

BATCH = 16
MAX_LEN = 10


@lru_cache(maxsize=1)
def _data() -> dict[str, SequenceDataset]:
    dm = MovieLensSequenceDataModule(str(movielens_dir()), download=False, max_len=MAX_LEN, num_negatives=8, seed=0)
    return {s: dm.split(s) for s in ("train", "val", "test")}


class _Module(SequentialRecModule):
    """The shipped module; its predictions also carry the held-out item's score (a float to compare to ``tol``,
    beside the integer rank)."""

    def predict_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        out = self(batch)
        target = batch["features"]["target"].values().long()
        score = catalog_scores(out).gather(1, target.unsqueeze(1)).squeeze(1)
        return {"users": batch["users"], "rank": self.ranks(batch, out), "score": score}


def _build() -> SequentialRecModule:
    num_items = _data()["train"].num_items
    # Row-wise Adagrad, as the shipped config: split row-wise, each row and its accumulator live whole on one rank,
    # so it updates like the unsharded table (split column-wise it would not: README "Checkpoints").
    return _Module(
        [SparseFeature("item", num_items)],
        embedding_dim=16,
        max_len=MAX_LEN,
        num_blocks=1,
        num_heads=2,
        dropout=0.0,
        dense_lr=0.003,
        embedding_optimizer=EmbeddingOptimizer("rowwise_adagrad", lr=0.05),
    )


def _batches(steps: int) -> list[Any]:
    train = _data()["train"]
    return [train[(0, torch.arange(i * BATCH, (i + 1) * BATCH))] for i in range(steps)]


def _heldout() -> Any:
    return _data()["test"][torch.arange(100, 132)]


def _share(batch: Any, rank: int, world_size: int) -> Any:
    """Training batches: a row slice. Evaluation batches: the dataset's batch of this rank's rows (its own catalog)."""
    if int(batch["features"]["catalog"].lengths().sum()) == 0:
        return share_rows(batch, rank, world_size)
    test = _data()["test"]
    row_of = {int(u): i for i, u in enumerate(test.users)}
    rows = torch.tensor([row_of[int(u)] for u in batch["users"]])
    return test[rows.tensor_split(world_size)[rank]]


def _loss(module: nn.Module, batch: Any) -> torch.Tensor:
    return module.loss(batch, module(batch))


def _optimizers(module: SequentialRecModule) -> list[torch.optim.Optimizer]:
    tables = list(module.model.item_ec.parameters())
    ids = {id(p) for p in tables}
    dense = [p for p in module.parameters() if id(p) not in ids]
    return [torch.optim.Adam(dense, lr=module.hparams.dense_lr), module.embedding_optimizer.torch_optimizer(tables)]


CASE = ZooCase(
    build=_build,
    batches=_batches,
    heldout=_heldout,
    share=_share,
    loss=_loss,
    optimizers=_optimizers,
    constraints={
        1: {"t_item": {"sharding_types": ["table_wise"]}},
        2: {"t_item": {"sharding_types": ["row_wise"]}},  # each rank owns half of the item rows
    },
)
