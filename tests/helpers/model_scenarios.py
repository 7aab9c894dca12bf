"""Per-rank scenarios for the reference models (run through tests.helpers.dist.run_ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L

from lightning_rec import RecShardStrategy
from lightning_rec.data.movielens import MovieLensDataModule
from lightning_rec.models import DLRMModule
from tests.helpers.models import deterministic_init

# Real sharding on 2 ranks: one column-wise, one table-wise table; the planner decides the rest.
MOVIELENS_PLAN = {"t_user_id": {"sharding_types": ["column_wise"]}, "t_item_id": {"sharding_types": ["table_wise"]}}


class _InitBeforeValidation(L.Callback):
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        deterministic_init(pl_module)


def validate_movielens(
    rank: int, world_size: int, out_dir: Path, data_dir: str, interaction: str = "dcn"
) -> dict[str, Any]:
    """Validate a DLRM with plan-independent weights on MovieLens; report the epoch metrics."""
    dm = MovieLensDataModule(data_dir, download=False, batch_size=700)
    model = DLRMModule(
        dm.sparse_features,
        dm.num_dense_features,
        embedding_dim=8,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
        interaction=interaction,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=RecShardStrategy(constraints=MOVIELENS_PLAN),
        callbacks=[_InitBeforeValidation()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(model, dm)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}
