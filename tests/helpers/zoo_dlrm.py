"""The zoo cases of the CTR models on MovieLens-100K rows: DLRM-DCNv2 (:class:`lightning_rec.models.DLRMModule`)
here, DeepFM in :mod:`tests.helpers.zoo_deepfm` through :func:`ctr_case`."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_rec.data.movielens import load_movielens
from lightning_rec.models import DLRMModule
from lightning_rec.models.base import CTRModule
from tests.helpers.data import movielens_dir
from tests.helpers.zoo import ZooCase, adam_and_rowwise_adagrad, share_rows

BATCH = 64


@lru_cache(maxsize=1)
def movielens():
    """MovieLens-100K ratings (a ``RecDataset``) and their features, read once per process."""
    return load_movielens(movielens_dir())


def _batches(steps: int) -> list[Any]:
    ds, _ = movielens()
    return [ds[torch.arange(i * BATCH, (i + 1) * BATCH)] for i in range(steps)]


def _loss(module: nn.Module, batch: Any) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(module(batch), batch.labels)


def _optimizers(module: CTRModule) -> list[torch.optim.Optimizer]:
    emb = module.embedding_optimizer
    tables = list(module.model.sparse_arch.parameters())
    return adam_and_rowwise_adagrad(module, tables, module.hparams.dense_lr, emb.lr, emb.eps)


def ctr_case(build: Callable[[], CTRModule], constraints: dict[int, dict[str, Any]]) -> ZooCase:
    """A CTR model (``model.sparse_arch`` holds its tables) on consecutive MovieLens ratings."""
    return ZooCase(
        build=build,
        batches=_batches,
        heldout=lambda: movielens()[0][torch.arange(5000, 5032)],
        share=share_rows,
        loss=_loss,
        optimizers=_optimizers,
        constraints=constraints,
    )


CASE = ctr_case(
    lambda: DLRMModule(
        movielens()[1],
        2,
        embedding_dim=8,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
        interaction="dcn",
    ),
    {
        1: {"t_user_id": {"sharding_types": ["column_wise"]}},
        2: {
            "t_user_id": {"sharding_types": ["column_wise"]},
            "t_item_id": {"sharding_types": ["table_wise"]},
            "t_genres": {"sharding_types": ["data_parallel"]},
        },
    },
)
