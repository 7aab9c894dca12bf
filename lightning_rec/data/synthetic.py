"""Synthetic click data with configurable tables, pooling factors and id distributions.

Ids are drawn uniformly or from a power law (a few hot ids take most lookups, as in real traffic); labels
come from a hidden ground truth (a score per id plus a linear term of the dense features), so models can
learn them and a falling loss means something. Everything is generated vectorised from one seed: a million
rows take about a second on one CPU core.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_rec._choices import check_choices
from lightning_rec.config import SparseFeature, checkpoint_safe
from lightning_rec.data.base import Jagged, RecDataModule, RecDataset, _Column

__all__ = ["SyntheticDataModule", "SyntheticTable", "make_synthetic_dataset"]

# Spread of the hidden logit, whatever the number of tables: oracle AUROC around 0.8, like click logs.
_LOGIT_SCALE = 1.5


@checkpoint_safe
@dataclass
class SyntheticTable:
    """One sparse feature of the synthetic data.

    Args:
        name: the feature name (its table is ``t_<name>`` in the reference models).
        num_embeddings: ids run from 0 to ``num_embeddings - 1``.
        pooling_factor: mean ids per sample of a ``multi_hot`` table (Poisson lengths, so possibly 0); a
            one-hot table has exactly one id per sample and must keep the default 1.0.
        multi_hot: several ids (or none) per sample; otherwise exactly one.
        distribution: ``"uniform"`` or ``"power_law"`` (Zipf-like: the k-th hottest id has weight
            ``k ** -alpha``; which ids are hot is a fixed random permutation, not ``0..k``).
        alpha: the power-law exponent (> 0; larger is more skewed).

    Example::

        >>> SyntheticTable("item", 100_000, distribution="power_law", alpha=1.1).multi_hot
        False
        >>> SyntheticTable("tags", 500, pooling_factor=4.0, multi_hot=True).pooling_factor
        4.0
    """

    name: str
    num_embeddings: int
    pooling_factor: float = 1.0
    multi_hot: bool = False
    distribution: Literal["uniform", "power_law"] = "uniform"
    alpha: float = 1.05

    def __post_init__(self) -> None:
        where = f"SyntheticTable {self.name!r}"
        if self.num_embeddings < 1:
            raise ValueError(f"{where}: num_embeddings must be >= 1, got {self.num_embeddings}.")
        check_choices(self, where)
        if self.pooling_factor <= 0:
            raise ValueError(f"{where}: pooling_factor must be > 0, got {self.pooling_factor}.")
        if not self.multi_hot and self.pooling_factor != 1.0:
            raise ValueError(
                f"{where}: a one-hot table has exactly one id per sample, but pooling_factor={self.pooling_factor}."
                " HINT: set multi_hot=True for several ids per sample."
            )
        if self.alpha <= 0:
            raise ValueError(f"{where}: alpha must be > 0, got {self.alpha}.")


@dataclass
class _Truth:
    """The hidden model behind the labels: it depends on the tables and the seed only."""

    scores: dict[str, torch.Tensor]  # table -> a score per id
    hot_order: dict[str, torch.Tensor]  # power-law table -> ids from hottest to coldest
    cdf: dict[str, torch.Tensor]  # power-law table -> cumulative lookup probability by hotness rank
    dense_weights: torch.Tensor
    bias: float  # minus the expected logit, so about half the labels are clicks


def _truth(tables: Sequence[SyntheticTable], num_dense_features: int, seed: int) -> _Truth:
    g = torch.Generator().manual_seed(seed)
    scores, hot_order, cdf = {}, {}, {}
    expected = 0.0
    for t in tables:
        scores[t.name] = torch.randn(t.num_embeddings, generator=g)
        if t.distribution == "power_law":
            hot_order[t.name] = torch.randperm(t.num_embeddings, generator=g)
            p = torch.arange(1, t.num_embeddings + 1, dtype=torch.float64).pow(-t.alpha)
            p /= p.sum()
            cdf[t.name] = p.cumsum(0)
            mean_score = float(p @ scores[t.name][hot_order[t.name]].double())
        else:
            mean_score = float(scores[t.name].double().mean())
        # a multi-hot sample averages its ids' scores, and one with no ids scores 0
        expected += mean_score * (1 - math.exp(-t.pooling_factor) if t.multi_hot else 1.0)
    dense_weights = torch.randn(num_dense_features, generator=g) / math.sqrt(max(num_dense_features, 1))
    return _Truth(scores, hot_order, cdf, dense_weights, -expected)


def _ids(table: SyntheticTable, truth: _Truth, n: int, g: torch.Generator) -> torch.Tensor:
    if table.distribution == "uniform":
        return torch.randint(table.num_embeddings, (n,), generator=g)
    # Inverse-CDF sampling of hotness ranks (torch.multinomial stops at 2**24 categories).
    u = torch.rand(n, generator=g, dtype=torch.float64)
    ranks = torch.searchsorted(truth.cdf[table.name], u, right=True).clamp_(max=table.num_embeddings - 1)
    return truth.hot_order[table.name][ranks]


def _draw(
    tables: Sequence[SyntheticTable], num_dense_features: int, rows: int, seed: int
) -> tuple[RecDataset, torch.Tensor]:
    """The dataset of ``rows`` synthetic rows drawn from ``seed``, and the hidden logit of each row (what an ideal
    model would predict)."""
    names = [t.name for t in tables]
    if not tables or len(set(names)) != len(names):
        raise ValueError(f"Synthetic data needs at least one table and unique table names, got {names}.")
    if rows < 0 or num_dense_features < 0:
        raise ValueError(f"Synthetic data: rows and num_dense_features must be >= 0, got {rows}, {num_dense_features}.")
    truth = _truth(tables, num_dense_features, seed)
    g = torch.Generator().manual_seed(seed * 1_000_003 + rows)
    dense = torch.randn(rows, num_dense_features, generator=g)
    logit = dense @ truth.dense_weights + truth.bias
    sparse: dict[str, _Column] = {}
    for t in tables:
        scores = truth.scores[t.name]
        if t.multi_hot:
            lengths = torch.poisson(torch.full((rows,), t.pooling_factor), generator=g).long()
            offsets = torch.zeros(rows + 1, dtype=torch.long)
            torch.cumsum(lengths, 0, out=offsets[1:])
            values = _ids(t, truth, int(offsets[-1]), g)
            sample = torch.repeat_interleave(torch.arange(rows), lengths)
            logit += torch.zeros(rows).index_add_(0, sample, scores[values]) / lengths.clamp(min=1)
            sparse[t.name] = Jagged(values, offsets)
        else:
            ids = _ids(t, truth, rows, g)
            logit += scores[ids]
            sparse[t.name] = ids
    logit *= _LOGIT_SCALE / math.sqrt(len(tables) + 1)
    labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
    return RecDataset(dense, labels, sparse), logit


def make_synthetic_dataset(
    tables: Sequence[SyntheticTable], num_dense_features: int, rows: int, seed: int = 0
) -> RecDataset:
    """Generate ``rows`` samples without Lightning.

    The hidden truth (id scores, which ids are hot, dense weights) depends on ``tables`` and ``seed`` only;
    the samples also depend on ``rows``, so two calls with different ``rows`` draw different samples from the
    same truth (:class:`SyntheticDataModule` draws once and splits instead).

    Args:
        tables: the sparse features, in ``KeyedJaggedTensor`` key order; names must be unique.
        num_dense_features: width of the dense features (standard normal).
        rows: number of samples.
        seed: fixes the truth and the samples.

    Example::

        >>> ds = make_synthetic_dataset([SyntheticTable("user", 100), SyntheticTable("tags", 50, 3.0, True)], 4, 1000)
        >>> len(ds), ds[torch.arange(2)].sparse_features.keys()
        (1000, ['user', 'tags'])
    """
    return _draw(tables, num_dense_features, rows, seed)[0]


class SyntheticDataModule(RecDataModule):
    """Synthetic train/val/test splits sharing one hidden truth (so validation measures learning).

    Every rank draws the same rows from ``seed`` (no broadcast needed) and reads its own batches of them.

    Args:
        tables: the sparse features.
        num_dense_features: width of the dense features (standard normal).
        train_rows: training rows.
        val_rows: validation rows (also used for prediction).
        test_rows: test rows (0: test on the validation split).
        batch_size: see :class:`~lightning_rec.data.base.RecDataModule`.
        num_workers: see :class:`~lightning_rec.data.base.RecDataModule`.
        seed: fixes the data, and the shuffling.

    Example::

        >>> dm = SyntheticDataModule([SyntheticTable("user", 10_000, distribution="power_law")], train_rows=5000)
        >>> dm.setup("fit")
        >>> [f.name for f in dm.sparse_features], dm.num_dense_features, len(dm.train_dataloader())
        (['user'], 13, 10)

    In YAML (``lightning-rec fit --config ...``)::

        data:
          class_path: lightning_rec.data.SyntheticDataModule
          init_args:
            tables:
              - {name: item, num_embeddings: 20000, distribution: power_law, alpha: 1.2}
              - {name: tags, num_embeddings: 1000, pooling_factor: 4.0, multi_hot: true}
    """

    def __init__(
        self,
        tables: list[SyntheticTable],
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
        if train_rows < 1 or val_rows < 1 or test_rows < 0:
            raise ValueError(
                f"SyntheticDataModule: needs train_rows >= 1, val_rows >= 1 and test_rows >= 0, got {train_rows},"
                f" {val_rows}, {test_rows}."
            )
        self.tables = list(tables)
        self._num_dense = num_dense_features
        self.rows = {"train": train_rows, "val": val_rows, "test": test_rows}
        self._splits: dict[str, RecDataset] | None = None

    @property
    def sparse_features(self) -> list[SparseFeature]:
        return [SparseFeature(t.name, t.num_embeddings, t.multi_hot) for t in self.tables]

    @property
    def num_dense_features(self) -> int:
        return self._num_dense

    def setup(self, stage: str) -> None:
        if self._splits is not None:
            return
        # one draw, then split: every split shares the hidden truth
        data = make_synthetic_dataset(self.tables, self._num_dense, sum(self.rows.values()), self.seed)
        bounds = torch.tensor([0, *self.rows.values()]).cumsum(0).tolist()
        self._splits = {name: data.subset(torch.arange(bounds[i], bounds[i + 1])) for i, name in enumerate(self.rows)}
        if not self.rows["test"]:
            self._splits["test"] = self._splits["val"]

    def split(self, name: str) -> RecDataset:
        """The rows of split ``name`` (after :meth:`setup`); ``predict`` runs over the validation rows."""
        if self._splits is None:
            raise RuntimeError("SyntheticDataModule: no data yet. HINT: call setup() first (the Trainer does).")
        return self._splits["val" if name == "predict" else name]
