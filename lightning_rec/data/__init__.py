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
from lightning_rec.data.criteo import CriteoDataModule, write_criteo_tsv
from lightning_rec.data.movielens import MovieLensDataModule, load_interactions, load_movielens, prepare_movielens
from lightning_rec.data.movielens_retrieval import MovieLensRetrievalDataModule
from lightning_rec.data.movielens_sequential import MovieLensSequenceDataModule
from lightning_rec.data.synthetic import SyntheticDataModule, SyntheticTable, make_synthetic_dataset

__all__ = [
    "CriteoDataModule",
    "write_criteo_tsv",
    "MovieLensDataModule",
    "MovieLensRetrievalDataModule",
    "MovieLensSequenceDataModule",
    "SyntheticDataModule",
    "SyntheticTable",
    "make_synthetic_dataset",
    "load_interactions",
    "load_movielens",
    "prepare_movielens",
    "DistributedBatchSampler",
    "Jagged",
    "RecDataModule",
    "RecDataset",
    "SparseFeature",
    "batch_loader",
    "rank_batches",
]
