"""DataModules: MovieLens (real data), Criteo-format click logs, synthetic data; and what they share."""

from lightning_rec.data.base import (
    DistributedBatchSampler,
    Jagged,
    RecDataModule,
    RecDataset,
    SparseFeature,
    batch_loader,
    rank_batches,
)

__all__ = [
    "DistributedBatchSampler",
    "Jagged",
    "RecDataModule",
    "RecDataset",
    "SparseFeature",
    "batch_loader",
    "rank_batches",
]
