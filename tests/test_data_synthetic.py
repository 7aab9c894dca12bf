"""Synthetic data: ranges, determinism, power-law skew, pooling, learnable labels, rank coverage."""

from __future__ import annotations

import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from lightning_rec.data import SyntheticDataModule, SyntheticTable, make_synthetic_dataset
from lightning_rec.data.base import rank_batches

TABLES = [
    SyntheticTable("hot", 10_000, distribution="power_law", alpha=1.1),
    SyntheticTable("flat", 10_000),
    SyntheticTable("tags", 500, pooling_factor=4.0, multi_hot=True),
]


def _all(ds):
    return ds[torch.arange(len(ds))]


def test_ids_in_range_and_seeded() -> None:
    a, b, c = (make_synthetic_dataset(TABLES, 5, 20_000, seed=s) for s in (0, 0, 1))
    kjt = _all(a).sparse_features.to_dict()
    for t in TABLES:
        ids = kjt[t.name].values()
        assert ids.min() >= 0 and ids.max() < t.num_embeddings
    assert torch.equal(_all(a).sparse_features.values(), _all(b).sparse_features.values())
    assert torch.equal(a.labels, b.labels)
    assert not torch.equal(a.labels, c.labels)


def test_power_law_is_skewed_and_uniform_is_not() -> None:
    kjt = _all(make_synthetic_dataset(TABLES, 1, 50_000)).sparse_features.to_dict()

    def top_share(ids: torch.Tensor, n: int) -> float:  # share of lookups going to the hottest 1% of ids
        return torch.bincount(ids, minlength=n).sort(descending=True).values[: n // 100].sum().item() / ids.numel()

    assert top_share(kjt["hot"].values(), 10_000) > 0.4
    assert top_share(kjt["flat"].values(), 10_000) < 0.03
    hottest = torch.bincount(kjt["hot"].values()).argmax().item()
    assert hottest != 0, "hot ids are permuted, not 0..k"


def test_pooling_factor_is_the_mean_length() -> None:
    lengths = _all(make_synthetic_dataset(TABLES, 1, 20_000)).sparse_features["tags"].lengths()
    assert lengths.float().mean().item() == pytest.approx(4.0, abs=0.1)
    assert lengths.min() == 0 and lengths.max() > 8  # really jagged


def test_labels_are_learnable() -> None:
    dm = SyntheticDataModule(TABLES, num_dense_features=4, train_rows=20_000, val_rows=5_000)
    dm.setup("fit")
    train = dm._split("train")
    val = dm._split("val")
    assert 0.2 < train.labels.mean().item() < 0.8
    # Per-id click rate learned on train predicts val: the truth is shared across splits.
    ids_train, ids_val = train.sparse["flat"], val.sparse["flat"]
    clicks = torch.zeros(10_000).index_add_(0, ids_train, train.labels)
    seen = torch.bincount(ids_train, minlength=10_000).float()
    rate = (clicks + 1) / (seen + 2)
    assert binary_auroc(rate[ids_val], val.labels.long()).item() > 0.55


def test_splits_are_disjoint_and_cover_rows_once_per_rank() -> None:
    dm = SyntheticDataModule(TABLES[:1], num_dense_features=2, train_rows=1000, val_rows=301, test_rows=0)
    dm.setup("fit")
    assert len(dm._split("train")) == 1000 and len(dm._split("val")) == 301
    assert dm._split("test").labels.equal(dm._split("val").labels)
    per_rank = [rank_batches(301, 64, rank=r, world_size=3) for r in range(3)]
    assert len({len(b) for b in per_rank}) == 1
    assert torch.equal(torch.cat([i for bs in per_rank for i in bs]).sort().values, torch.arange(301))


def test_bad_table_is_named() -> None:
    with pytest.raises(ValueError, match="'x'.*num_embeddings"):
        SyntheticTable("x", 0)
