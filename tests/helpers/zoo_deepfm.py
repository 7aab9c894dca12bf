"""The zoo case of DeepFM (:class:`lightning_rec.models.DeepFMModule`) on MovieLens-100K rows."""

from __future__ import annotations

from lightning_rec.models import DeepFMModule
from tests.helpers.zoo_dlrm import ctr_case, movielens

CASE = ctr_case(
    lambda: DeepFMModule(
        movielens()[1],
        2,
        embedding_dim=8,
        dense_arch_hidden_size=8,
        deep_layer_sizes=[16, 8],
        over_arch_layer_sizes=[8, 1],
        dense_lr=0.003,
    ),
    {
        1: {"t_user_id": {"sharding_types": ["column_wise"]}},
        # The shipped config's kinds, plus a replicated table: three sharding types on 2 ranks.
        2: {
            "t_user_id": {"sharding_types": ["column_wise"]},
            "t_item_id": {"sharding_types": ["table_wise"]},
            "t_zip": {"sharding_types": ["table_wise"]},
            "t_genres": {"sharding_types": ["data_parallel"]},
        },
    },
)
