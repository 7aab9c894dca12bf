"""Synthetic data: ranges, determinism, power-law skew, pooling, learnable labels, rank coverage, YAML."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from jsonargparse import ArgumentParser
from torchmetrics.functional.classification import binary_auroc

from lightning_rec.data import SyntheticDataModule, SyntheticTable, make_synthetic_dataset
from lightning_rec.data.synthetic import _draw

TABLES = [
    SyntheticTable("hot", 10_000, distribution="power_law", alpha=1.1),
    SyntheticTable("flat", 10_000),
    SyntheticTable("tags", 500, pooling_factor=4.0, multi_hot=True),
]


def _kjt(ds):
    return ds[torch.arange(len(ds))].sparse_features.to_dict()


def _top_share(ids: torch.Tensor, n: int) -> float:
    """The share of lookups that go to the hottest 1% of the ``n`` ids."""
    return torch.bincount(ids, minlength=n).sort(descending=True).values[: n // 100].sum().item() / ids.numel()


def test_ids_in_range_and_seeded() -> None:
    a, b, c = (make_synthetic_dataset(TABLES, 5, 20_000, seed=s) for s in (0, 0, 1))
    ka, kb, kc = _kjt(a), _kjt(b), _kjt(c)
    for t in TABLES:
        ids = ka[t.name].values()
        assert ids.min() >= 0 and ids.max() < t.num_embeddings
        assert torch.equal(ids, kb[t.name].values()), "same seed, same ids"
        assert not torch.equal(ids[:1000], kc[t.name].values()[:1000]), "another seed, other ids"
    assert torch.equal(a.labels, b.labels) and torch.equal(a.dense, b.dense)
    assert not torch.equal(a.labels, c.labels)


def test_power_law_is_skewed_and_uniform_is_not() -> None:
    kjt = _kjt(make_synthetic_dataset(TABLES, 1, 50_000))
    assert _top_share(kjt["hot"].values(), 10_000) > 0.4
    assert _top_share(kjt["flat"].values(), 10_000) < 0.03
    hottest = torch.bincount(kjt["hot"].values(), minlength=10_000).argsort(descending=True)[:100]
    assert hottest.max() > 1000, "hot ids are a random permutation, not 0..99"


def test_power_law_beyond_multinomial_limit() -> None:
    n = 2**24 + 10  # torch.multinomial refuses more categories than 2**24
    ids = _kjt(make_synthetic_dataset([SyntheticTable("big", n, distribution="power_law")], 0, 5000))["big"].values()
    assert ids.min() >= 0 and ids.max() < n
    assert torch.unique(ids).numel() < 0.8 * ids.numel(), "hot ids repeat even in a huge table"


def test_pooling_factor_is_the_mean_length() -> None:
    tables = [*TABLES, SyntheticTable("rare", 100, pooling_factor=0.3, multi_hot=True, distribution="power_law")]
    kjt = _kjt(make_synthetic_dataset(tables, 1, 20_000))
    tags = kjt["tags"].lengths()
    assert tags.float().mean().item() == pytest.approx(4.0, abs=0.1)
    assert tags.min() == 0 and tags.max() > 8, "lengths really vary"
    assert kjt["rare"].lengths().float().mean().item() == pytest.approx(0.3, abs=0.03)
    assert torch.equal(kjt["flat"].lengths(), torch.ones(20_000, dtype=kjt["flat"].lengths().dtype))


def test_labels_follow_the_hidden_truth() -> None:
    ds, logit = _draw(TABLES, 4, 20_000, seed=0)
    assert 0.3 < ds.labels.mean().item() < 0.7
    assert set(ds.labels.unique().tolist()) == {0.0, 1.0}
    assert binary_auroc(logit, ds.labels.long()).item() > 0.75
    shuffled = logit[torch.randperm(20_000, generator=torch.Generator().manual_seed(0))]
    assert binary_auroc(shuffled, ds.labels.long()).item() < 0.55, "the check above can fail"


def test_labels_are_learnable_from_train_to_val() -> None:
    dm = SyntheticDataModule(TABLES, num_dense_features=4, train_rows=40_000, val_rows=10_000)
    dm.setup("fit")
    train, val = dm.split("train"), dm.split("val")
    # An estimate fitted on train predicts val only if the truth is shared and visible in the data.
    clicks = torch.zeros(10_000).index_add_(0, train.sparse["hot"], train.labels)
    seen = torch.bincount(train.sparse["hot"], minlength=10_000).float()
    rate = (clicks + 1) / (seen + 2)
    assert binary_auroc(rate[val.sparse["hot"]], val.labels.long()).item() > 0.55
    x = torch.cat([train.dense, torch.ones(len(train), 1)], 1)
    w = torch.linalg.lstsq(x, train.labels[:, None]).solution
    assert binary_auroc(val.dense @ w[:4, 0], val.labels.long()).item() > 0.55


@pytest.mark.parametrize("world_size", [1, 3])
def test_loaders_cover_every_row_once_per_rank(world_size: int) -> None:
    dm = SyntheticDataModule(TABLES, num_dense_features=2, train_rows=1000, val_rows=301, batch_size=64)
    dm.setup("fit")
    assert dm.split("test") is dm.split("val"), "test_rows=0 tests on the validation rows"
    for name, loader_fn in [("train", dm.train_dataloader), ("val", dm.val_dataloader)]:
        seen, counts = [], set()
        for rank in range(world_size):
            dm.trainer = SimpleNamespace(global_rank=rank, world_size=world_size)
            batches = list(loader_fn())
            counts.add(len(batches))
            assert all(b.labels.numel() <= 64 for b in batches)
            seen.append(torch.cat([b.dense_features for b in batches]))
        assert len(counts) == 1, "every rank must run the same number of batches"
        rows = torch.cat(seen)
        split = dm.split(name).dense  # dense rows are continuous draws, so they identify rows
        assert rows.shape == split.shape
        assert torch.equal(torch.unique(rows, dim=0), torch.unique(split, dim=0))
    dm.trainer = None


def test_yaml_config_fills_the_typed_arguments() -> None:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(SyntheticDataModule, "data")
    cfg = parser.parse_string(
        "data:\n  tables:\n    - {name: item, num_embeddings: 100, distribution: power_law, alpha: 1.2}\n"
        "    - {name: tags, num_embeddings: 10, pooling_factor: 2.5, multi_hot: true}\n  train_rows: 50\n"
    )
    dm = parser.instantiate_classes(cfg).data
    assert dm.tables == [
        SyntheticTable("item", 100, distribution="power_law", alpha=1.2),
        SyntheticTable("tags", 10, pooling_factor=2.5, multi_hot=True),
    ]
    assert dm.rows["train"] == 50
    with pytest.raises(Exception, match="zipf|distribution"):
        parser.parse_string("data:\n  tables:\n    - {name: item, num_embeddings: 100, distribution: zipf}\n")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SyntheticTable("x", 0), "'x'.*num_embeddings"),
        (lambda: SyntheticTable("x", 10, pooling_factor=3.0), "'x'.*one-hot.*HINT: set multi_hot"),
        (lambda: SyntheticTable("x", 10, distribution="power_law", alpha=0.0), "'x'.*alpha"),
        (lambda: make_synthetic_dataset([SyntheticTable("x", 5), SyntheticTable("x", 5)], 1, 10), "unique"),
        (lambda: SyntheticDataModule([]), "at least one table"),
        (lambda: SyntheticDataModule(TABLES, val_rows=0), "val_rows >= 1"),
        (lambda: SyntheticDataModule(TABLES).train_dataloader(), "setup"),
    ],
)
def test_bad_configs_say_what_is_wrong(make, match: str) -> None:
    with pytest.raises((ValueError, RuntimeError), match=match):
        make()
