"""Synthetic click data with configurable tables, pooling factors and id distributions.

Ids are drawn uniformly or from a power law (a few hot ids take most lookups, as in real traffic); labels
come from a hidden ground truth (a score per id plus a linear term of the dense features), so models can
learn them and a falling loss means something. Everything is generated vectorised from one seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Literal, Optional, Sequence

import torch

from lightning_rec.data.base import Column, Jagged, RecDataModule, RecDataset, SparseFeature

__all__ = ["SyntheticDataModule", "SyntheticTable", "make_synthetic_dataset"]


@dataclass
class SyntheticTable:
    """One sparse feature of the synthetic data.

    Args:
        name: the feature name (its table is ``t_<name>`` in the reference models).
        num_embeddings: ids run from 0 to ``num_embeddings - 1``.
        pooling_factor: mean ids per sample when ``multi_hot`` (Poisson lengths, possibly 0).
        multi_hot: several ids per sample; otherwise exactly one.
        distribution: ``"uniform"`` or ``"power_law"`` (Zipf-like: the k-th hottest id has weight
            ``k ** -alpha``; which ids are hot is a fixed random permutation, not ``0..k``).
        alpha: the power-law exponent.

    Example::

        SyntheticTable("item", 100_000, distribution="power_law", alpha=1.1)
    """

    name: str
    num_embeddings: int
    pooling_factor: float = 1.0
    multi_hot: bool = False
    distribution: Literal["uniform", "power_law"] = "uniform"
    alpha: float = 1.05

    def __post_init__(self) -> None:
        if self.num_embeddings < 1:
            raise ValueError(f"SyntheticTable {self.name!r}: num_embeddings must be >= 1, got {self.num_embeddings}.")
        if self.distribution not in ("uniform", "power_law"):
            raise ValueError(f"SyntheticTable {self.name!r}: distribution must be 'uniform' or 'power_law'.")
        if self.pooling_factor <= 0:
            raise ValueError(f"SyntheticTable {self.name!r}: pooling_factor must be > 0, got {self.pooling_factor}.")


def _ids(table: SyntheticTable, n: int, g: torch.Generator) -> torch.Tensor:
    if table.distribution == "uniform":
        return torch.randint(table.num_embeddings, (n,), generator=g)
    weights = torch.arange(1, table.num_embeddings + 1, dtype=torch.float64).pow(-table.alpha)
    ranks = torch.multinomial(weights, n, replacement=True, generator=g)
    return torch.randperm(table.num_embeddings, generator=g)[ranks]


def make_synthetic_dataset(
    tables: Sequence[SyntheticTable], num_dense_features: int, rows: int, seed: int = 0
) -> RecDataset:
    """Generate ``rows`` samples. The hidden truth depends on ``seed`` only, so splits drawn with different
    ``rows`` but the same seed share it (use :class:`SyntheticDataModule` for consistent train/val splits).

    Example::

        >>> ds = make_synthetic_dataset([SyntheticTable("user", 100), SyntheticTable("tags", 50, 3.0, True)], 4, 1000)
        >>> len(ds), ds[torch.arange(2)].sparse_features.keys()
        (1000, ['user', 'tags'])
    """
    truth = torch.Generator().manual_seed(seed)
    scores = {t.name: torch.randn(t.num_embeddings, generator=truth) for t in tables}
    dense_weights = torch.randn(num_dense_features, generator=truth) * 0.5
    g = torch.Generator().manual_seed(seed * 1_000_003 + rows)
    dense = torch.randn(rows, num_dense_features, generator=g)
    logit = dense @ dense_weights
    sparse: Dict[str, Column] = {}
    for t in tables:
        if t.multi_hot:
            lengths = torch.poisson(torch.full((rows,), t.pooling_factor), generator=g).long()
            offsets = torch.zeros(rows + 1, dtype=torch.long)
            torch.cumsum(lengths, 0, out=offsets[1:])
            values = _ids(t, int(offsets[-1]), g)
            col = Jagged(values, offsets)
            sample = torch.repeat_interleave(torch.arange(rows), lengths)
            logit += torch.zeros(rows).index_add_(0, sample, scores[t.name][values]) / lengths.clamp(min=1)
        else:
            col = _ids(t, rows, g)
            logit += scores[t.name][col]
        sparse[t.name] = col
    labels = torch.bernoulli(torch.sigmoid(logit - logit.mean()), generator=g)
    return RecDataset(dense, labels, sparse)


class SyntheticDataModule(RecDataModule):
    """Synthetic train/val/test splits sharing one hidden truth (so validation measures learning).

    Args:
        tables: the sparse features.
        num_dense_features: width of the dense features (standard normal).
        train_rows, val_rows, test_rows: split sizes (test 0: test on the validation split).
        batch_size, num_workers, seed: see :class:`~lightning_rec.data.base.RecDataModule`; ``seed`` also fixes
            the data.

    Example::

        dm = SyntheticDataModule([SyntheticTable("user", 10_000, distribution="power_law")], train_rows=50_000)
    """

    def __init__(
        self,
        tables: List[SyntheticTable],
        num_dense_features: int = 13,
        train_rows: int = 100_000,
        val_rows: int = 10_000,
        test_rows: int = 0,
        batch_size: int = 512,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        if not tables:
            raise ValueError("SyntheticDataModule: needs at least one table.")
        self.tables = list(tables)
        self._num_dense = num_dense_features
        self.rows = {"train": train_rows, "val": val_rows, "test": test_rows}
        self._data: Optional[RecDataset] = None

    @property
    def sparse_features(self) -> List[SparseFeature]:
        return [SparseFeature(t.name, t.num_embeddings, t.multi_hot) for t in self.tables]

    @property
    def num_dense_features(self) -> int:
        return self._num_dense

    def setup(self, stage: str) -> None:
        if self._data is None:  # one draw, then split: every split shares the hidden truth
            self._data = make_synthetic_dataset(self.tables, self._num_dense, sum(self.rows.values()), self.seed)

    def _split(self, name: str) -> RecDataset:
        assert self._data is not None, "call setup() first"
        if name == "test" and not self.rows["test"]:
            name = "val"
        start = {"train": 0, "val": self.rows["train"], "test": self.rows["train"] + self.rows["val"]}[name]
        return self._data.subset(torch.arange(start, start + self.rows[name]))

    def train_dataloader(self):
        return self.loader(self._split("train"), shuffle=True)

    def val_dataloader(self):
        return self.loader(self._split("val"), shuffle=False)

    def test_dataloader(self):
        return self.loader(self._split("test"), shuffle=False)

    def predict_dataloader(self):
        return self.loader(self._split("val"), shuffle=False)
