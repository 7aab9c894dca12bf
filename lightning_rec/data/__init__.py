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
from lightning_rec.data.movielens import MovieLensDataModule, load_movielens, prepare_movielens
from lightning_rec.data.movielens_retrieval import MovieLensRetrievalDataModule  # noqa: F401 (issue 15 model zoo)
from lightning_rec.data.movielens_sequential import MovieLensSequenceDataModule  # noqa: F401 (issue 15 model zoo)
from lightning_rec.data.synthetic import SyntheticDataModule, SyntheticTable, make_synthetic_dataset

__all__ = [
    "CriteoDataModule",
    "write_criteo_tsv",
    "MovieLensDataModule",
    "SyntheticDataModule",
    "SyntheticTable",
    "make_synthetic_dataset",
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
