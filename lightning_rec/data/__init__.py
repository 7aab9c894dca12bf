"""DataModules: MovieLens (real data), Criteo-format click logs, synthetic data, your own Parquet/CSV tables through a
schema; and what they share."""

from lightning_rec.config import SparseFeature
from lightning_rec.data._movielens_files import export_parquet, prepare_movielens
from lightning_rec.data._tabular_split import SplitRule
from lightning_rec.data.base import (
    DistributedBatchSampler,
    Jagged,
    RecDataModule,
    RecDataset,
    batch_loader,
    rank_batches,
)
from lightning_rec.data.criteo import CriteoDataModule, write_criteo_tsv
from lightning_rec.data.movielens import Interactions, MovieLensDataModule, load_interactions, load_movielens
from lightning_rec.data.movielens_retrieval import MovieLensRetrievalDataModule, RetrievalSplits, retrieval_splits
from lightning_rec.data.movielens_sequential import MovieLensSequenceDataModule, SequenceSplits, sequence_splits
from lightning_rec.data.periods import Period
from lightning_rec.data.schema import DataError, DenseColumn, LabelColumn, Schema, SparseColumn
from lightning_rec.data.synthetic import SyntheticDataModule, SyntheticTable, make_synthetic_dataset
from lightning_rec.data.tabular import TabularDataModule

__all__ = [
    "CriteoDataModule",
    "write_criteo_tsv",
    "MovieLensDataModule",
    "MovieLensRetrievalDataModule",
    "MovieLensSequenceDataModule",
    "Interactions",
    "RetrievalSplits",
    "retrieval_splits",
    "SequenceSplits",
    "sequence_splits",
    "SyntheticDataModule",
    "SyntheticTable",
    "make_synthetic_dataset",
    "load_interactions",
    "load_movielens",
    "prepare_movielens",
    "export_parquet",
    "TabularDataModule",
    "Period",
    "Schema",
    "LabelColumn",
    "DenseColumn",
    "SparseColumn",
    "SplitRule",
    "DataError",
    "DistributedBatchSampler",
    "Jagged",
    "RecDataModule",
    "RecDataset",
    "SparseFeature",
    "batch_loader",
    "rank_batches",
]
