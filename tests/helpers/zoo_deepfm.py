"""The zoo case of DeepFM (:class:`lightning_rec.models.DeepFMModule`) on MovieLens-100K rows."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, List

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.optim import RowWiseAdagrad

from lightning_rec.data.movielens import load_movielens
from lightning_rec.models import DeepFMModule
from tests.helpers.data import movielens_dir
from tests.helpers.zoo import ZooCase, share_rows

BATCH = 64


@lru_cache(maxsize=1)
def _data():
    return load_movielens(movielens_dir())


def _build() -> DeepFMModule:
    _, features = _data()
    return DeepFMModule(features, 2, embedding_dim=8, dense_arch_hidden_size=8, deep_layer_sizes=[16, 8],
                        over_arch_layer_sizes=[8, 1], dense_lr=0.003)


def _batches(steps: int) -> List[Any]:
    ds, _ = _data()
    return [ds[torch.arange(i * BATCH, (i + 1) * BATCH)] for i in range(steps)]


def _loss(module: nn.Module, batch: Any) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(module(batch), batch.labels)


def _optimizers(module: DeepFMModule) -> List[torch.optim.Optimizer]:
    tables = list(module.model.sparse_arch.parameters())
    ids = {id(p) for p in tables}
    dense = [p for p in module.parameters() if id(p) not in ids]
    emb = module.embedding_optimizer
    return [torch.optim.Adam(dense, lr=module.hparams.dense_lr), RowWiseAdagrad(tables, lr=emb.lr, eps=emb.eps)]


CASE = ZooCase(
    build=_build,
    batches=_batches,
    heldout=lambda: _data()[0][torch.arange(5000, 5032)],
    share=share_rows,
    loss=_loss,
    optimizers=_optimizers,
    constraints={
        1: {"t_user_id": {"sharding_types": ["column_wise"]}},
        # The shipped config's kinds, plus a replicated table: three sharding types on 2 ranks.
        2: {"t_user_id": {"sharding_types": ["column_wise"]}, "t_item_id": {"sharding_types": ["table_wise"]},
            "t_zip": {"sharding_types": ["table_wise"]}, "t_genres": {"sharding_types": ["data_parallel"]}},
    },
)
