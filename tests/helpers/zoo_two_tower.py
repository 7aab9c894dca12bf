"""The zoo case of the two-tower retrieval model (:class:`lightning_rec.models.TwoTowerModule`) on MovieLens-100K
training pairs: manual optimization with Adam (MLPs) + row-wise Adagrad (tables), a weighted table collection with
one shared table, and an in-batch softmax whose negatives are gathered from every rank."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from lightning_rec.data.movielens import load_interactions
from lightning_rec.data.movielens_retrieval import RetrievalSplits, retrieval_splits
from lightning_rec.models.two_tower import TwoTowerModule
from tests.helpers.data import movielens_dir
from tests.helpers.zoo import ZooCase, adam_and_rowwise_adagrad, share_rows

BATCH = 64


@functools.lru_cache(maxsize=1)
def _splits() -> RetrievalSplits:
    return retrieval_splits(load_interactions(movielens_dir()))


def _features():
    from lightning_rec.data.movielens_retrieval import MovieLensRetrievalDataModule

    return MovieLensRetrievalDataModule(str(movielens_dir()), download=False).sparse_features


def _build() -> TwoTowerModule:
    return TwoTowerModule(_features(), embedding_dim=8, query_layer_sizes=[16, 8], candidate_layer_sizes=[16, 8])


def _rows(start: int) -> Any:
    # rows spread over many users (every 37th training pair), so batches mix users, histories and repeated items
    return _splits().train[torch.arange(start, start + BATCH * 37, 37)]


def _batches(steps: int) -> list[Any]:
    return [_rows(i * BATCH * 37) for i in range(steps)]


def _loss(module: nn.Module, batch: Any) -> torch.Tensor:
    return module.loss(batch)


def _optimizers(module: TwoTowerModule) -> list[torch.optim.Optimizer]:
    hp = module.hparams
    return adam_and_rowwise_adagrad(module, module.table_parameters(), hp.dense_lr, hp.table_lr, hp.table_eps)


CASE = ZooCase(
    build=_build,
    batches=_batches,
    heldout=lambda: _rows(40000),
    share=share_rows,
    loss=_loss,
    optimizers=_optimizers,
    # No column-wise table on 2 ranks: row-wise Adagrad keeps one accumulator per row *and column shard*, which is not
    # plain RowWiseAdagrad once a row is updated twice (README, "Reshard"); tests/models/test_two_tower.py
    # evaluates with column-wise tables instead.
    constraints={
        1: {"t_user_id": {"sharding_types": ["column_wise"]}},
        2: {
            "t_user_id": {"sharding_types": ["table_wise"]},
            "t_item_id": {"sharding_types": ["table_wise"]},
            "t_history": {"sharding_types": ["table_wise"]},
            "t_genres": {"sharding_types": ["data_parallel"]},
        },
    },
)
