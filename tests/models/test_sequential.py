"""Sequential next-item prediction (issue 15): the leave-one-out split, the rows and batches, the popularity baseline,
the ranking against brute force, SASRec's forward and loss, HR/NDCG on 2 ranks = 1 rank, and the shipped config."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torchrec import EmbeddingCollection

from lightning_rec import RecShardStrategy
from lightning_rec.config import SEQUENCE_FEATURES, SparseFeature
from lightning_rec.data.base import DistributedBatchSampler
from lightning_rec.data.movielens import load_interactions
from lightning_rec.data.movielens_sequential import MovieLensSequenceDataModule, popularity_ranks, sequence_splits
from lightning_rec.metrics import RankingMetrics, exclusion_mask, target_rank
from lightning_rec.models.sequential import SASRec, SequentialRecModule, sampled_softmax_loss
from tests.helpers import zoo_sequential
from tests.helpers.data import MOVIELENS_DIR, REPO, movielens_dir
from tests.helpers.dist import run_ranks
from tests.helpers.zoo import check_case


@pytest.fixture(scope="module")
def dm() -> MovieLensSequenceDataModule:
    return MovieLensSequenceDataModule(str(movielens_dir()), download=False, max_len=20, num_negatives=7, seed=3)


def _user_histories(it) -> dict:
    """Brute force: each user's items sorted by (timestamp, file position)."""
    rows = sorted(range(len(it.user)), key=lambda i: (int(it.user[i]), int(it.timestamp[i]), i))
    out: dict = {}
    for i in rows:
        out.setdefault(int(it.user[i]), []).append(int(it.item[i]))
    return out


def test_leave_one_out_on_movielens(dm: MovieLensSequenceDataModule) -> None:
    it = load_interactions(dm.data_dir)
    split = dm.splits
    truth = _user_histories(it)
    assert split.users.tolist() == sorted(truth) and len(truth) == 943
    assert split.train.values.numel() == 100_000 - 2 * 943  # exactly one val and one test item per user
    assert (split.val > 0).all() and (split.test > 0).all()
    last_time: dict = {}
    time_of: dict = {}
    for u, i, t in zip(it.user.tolist(), it.item.tolist(), it.timestamp.tolist()):
        last_time[u] = max(last_time.get(u, t), t)
        time_of[(u, i)] = t  # MovieLens rates an item once per user
    assert len(time_of) == 100_000
    offsets = split.train.offsets.tolist()
    values, val, test = split.train.values.tolist(), split.val.tolist(), split.test.tolist()
    for row, user in enumerate(split.users.tolist()):
        train = values[offsets[row] : offsets[row + 1]]
        assert train + [val[row], test[row]] == truth[user]  # time order, ties by file order
        assert time_of[(user, test[row])] == last_time[user]  # the test item is (one of) the latest
        assert all(time_of[(user, i)] <= time_of[(user, val[row])] for i in train)
        assert test[row] not in train and val[row] not in train  # no leak into history
        assert test[row] != val[row]


def test_leave_one_out_ties_and_short_users() -> None:
    # user 5: two items at time 1 (file order decides), user 6: only two items (train only, no evaluation)
    s = sequence_splits(
        torch.tensor([5, 6, 5, 5, 6, 5]), torch.tensor([10, 20, 11, 12, 21, 13]), torch.tensor([1, 0, 1, 0, 1, 2]), 22
    )
    assert s.users.tolist() == [5, 6]
    assert s.train.values.tolist() == [12, 10, 20, 21] and s.train.offsets.tolist() == [0, 2, 4]
    assert s.val.tolist() == [11, -1] and s.test.tolist() == [13, -1]
    assert s.evaluated().tolist() == [0]
    with pytest.raises(ValueError, match="HINT"):
        sequence_splits(torch.tensor([1]), torch.tensor([1, 2]), torch.tensor([0]), 3)


def test_rows_and_batches(dm: MovieLensSequenceDataModule) -> None:
    split, ds = dm.splits, {s: dm.split(s) for s in ("train", "val", "test")}
    train_rows = [split.train.values[split.train.offsets[i] : split.train.offsets[i + 1]] for i in range(943)]
    b = ds["train"][(0, torch.arange(943))]
    kjt = b["features"]
    assert kjt.keys() == list(SEQUENCE_FEATURES)
    hist, tgt = kjt["history"], kjt["target"]
    for i in (0, 1, 500, 942):
        full = train_rows[i]
        assert hist.to_dense()[i].tolist() == full[:-1][-20:].tolist()
        assert tgt.to_dense()[i].tolist() == full[1:][-20:].tolist()  # shifted by one
    assert kjt["negatives"].lengths().tolist() == [7] * 943 and kjt["catalog"].lengths().sum() == 0
    negatives = kjt["negatives"].values()
    assert int(negatives.min()) >= 1 and int(negatives.max()) < dm.num_items
    # negatives depend on (epoch, row), not on how rows are batched (so not on the number of ranks)
    part = ds["train"][(0, torch.tensor([500, 3]))]["features"]["negatives"].values().reshape(2, 7)
    assert torch.equal(part, negatives.reshape(943, 7)[[500, 3]])
    assert not torch.equal(ds["train"][(1, torch.arange(943))]["features"]["negatives"].values(), negatives)

    for stage, held in (("val", split.val), ("test", split.test)):
        e = ds[stage][torch.tensor([7, 8])]
        f = e["features"]
        seen = [torch.cat([train_rows[i], split.val[i : i + 1]]) if stage == "test" else train_rows[i] for i in (7, 8)]
        assert f["target"].values().tolist() == held[[7, 8]].tolist()
        assert f["history"].to_dense()[1].tolist() == seen[1][-20:].tolist()
        assert e["seen_values"].tolist() == torch.cat(seen).tolist() and e["seen_lengths"].tolist() == [
            len(s) for s in seen
        ]
        assert f["catalog"].lengths().tolist() == [dm.num_items, 0] and f["catalog"].values().tolist() == list(
            range(dm.num_items)
        )
        assert f["negatives"].lengths().sum() == 0
        assert all(int(h) not in s.tolist() for h, s in zip(held[[7, 8]], seen))


def test_rank_aware_batches_cover_rows_once(dm: MovieLensSequenceDataModule) -> None:
    ds = dm.split("val")
    samplers = [
        DistributedBatchSampler(ds, 100, num_replicas=2, rank=r, shuffle=True, seed=1, with_epoch=True) for r in (0, 1)
    ]
    per_rank = [list(sampler) for sampler in samplers]
    assert len(per_rank[0]) == len(per_rank[1]) == 5
    assert all(epoch == 0 for r in per_rank for epoch, _ in r)
    rows = torch.cat([idx for r in per_rank for _, idx in r]).sort().values
    assert torch.equal(rows, torch.arange(943))


def _brute_rank(scores: list[float], target: int, excluded: set) -> int:
    order = sorted((c for c in range(len(scores)) if c not in excluded or c == target), key=lambda c: (-scores[c], c))
    return order.index(target)


def test_ranks_and_metrics_against_brute_force() -> None:
    g = torch.Generator().manual_seed(0)
    b, n = 40, 30
    scores = torch.randint(0, 6, (b, n), generator=g).double()  # many ties
    target = torch.randint(1, n, (b,), generator=g)
    lengths = torch.randint(0, 8, (b,), generator=g)
    seen = torch.randint(1, n, (int(lengths.sum()),), generator=g)
    ranks = target_rank(scores, target, exclusion_mask(seen, lengths, target, n))
    starts = torch.cumsum(lengths, 0) - lengths
    brute = [
        _brute_rank(scores[i].tolist(), int(target[i]), set(seen[starts[i] : starts[i] + lengths[i]].tolist()) | {0})
        for i in range(b)
    ]
    assert ranks.tolist() == brute
    m = RankingMetrics(ks=(1, 5, 10), prefix="t/", hit_name="hr")
    m.update(ranks[:17])
    m.update(ranks[17:])
    got = m.compute()
    for k in (1, 5, 10):
        assert got[f"t/hr@{k}"].item() == sum(r < k for r in brute) / b
        assert got[f"t/ndcg@{k}"].item() == pytest.approx(
            sum(1 / math.log2(r + 2) for r in brute if r < k) / b, abs=1e-12
        )


def test_popularity_baseline(dm: MovieLensSequenceDataModule) -> None:
    split = dm.splits
    counts = torch.bincount(split.train.values, minlength=dm.num_items).tolist()
    ranks = popularity_ranks(split, "test")
    for row in range(0, 943, 47):  # brute force on a sample of users
        train = set(split.train.values[split.train.offsets[row] : split.train.offsets[row + 1]].tolist())
        excluded = train | {int(split.val[row]), 0}
        assert int(ranks[row]) == _brute_rank(counts, int(split.test[row]), excluded)
    m = RankingMetrics(ks=(10,), hit_name="hr")
    m.update(ranks)
    hits = int(round(m.compute()["hr@10"].item() * 943))
    assert hits == 81  # BENCHMARKS.md: test HR@10 0.0859
    m = RankingMetrics(ks=(10,), hit_name="hr")
    m.update(popularity_ranks(split, "val"))
    assert int(round(m.compute()["hr@10"].item() * 943)) == 70  # val HR@10 0.0742


def _unsharded(num_items: int, **kwargs) -> SASRec:
    torch.manual_seed(0)
    net = SASRec(num_items, **kwargs)
    net.item_ec = EmbeddingCollection(tables=net.item_ec.embedding_configs(), device=torch.device("cpu"))
    return net


def test_forward_shapes_causality_and_loss(dm: MovieLensSequenceDataModule) -> None:
    net = _unsharded(dm.num_items, embedding_dim=16, max_len=20, num_blocks=2, num_heads=2, dropout=0.0).eval()
    ds = {s: dm.split(s) for s in ("train", "val", "test")}
    batch = ds["train"][(0, torch.arange(6))]
    out = net(batch["features"])
    assert out["hidden"].shape == (6, 20, 16) and out["last"].shape == (6, 16)
    assert out["negatives"].shape == (6, 7, 16) and out["target"].shape == (6, 20, 16) and "catalog" not in out
    # causal: changing the last history item of row 0 changes no earlier position
    kjt = batch["features"]
    values = kjt.values().clone()
    n0 = int(kjt["history"].lengths()[0])
    values[n0 - 1] = 1 if values[n0 - 1] != 1 else 2
    changed = net(type(kjt).from_lengths_sync(kjt.keys(), values, kjt.lengths()))["hidden"]
    assert torch.equal(changed[0, : n0 - 1], out["hidden"][0, : n0 - 1])
    assert not torch.allclose(changed[0, n0 - 1], out["hidden"][0, n0 - 1])
    # the loss against an explicit loop over rows and positions
    module = SequentialRecModule([dm.sparse_features[0]], embedding_dim=16, max_len=20, dropout=0.0)
    module.model = net
    loss = module.loss(batch, out)
    negs = kjt["negatives"].values().reshape(6, 7)
    per_row = []
    for i in range(6):
        n = int(kjt["history"].lengths()[i])
        targets = kjt["target"].to_dense()[i]
        terms = []
        for t in range(n):
            h = out["hidden"][i, t]
            pos = h @ out["target"][i, t]
            neg = torch.stack([h @ out["negatives"][i, k] for k in range(7) if negs[i, k] != targets[t]])
            terms.append(torch.logsumexp(torch.cat([pos.reshape(1), neg]), 0) - pos)
        per_row.append(torch.stack(terms).mean())
    assert loss.item() == pytest.approx(torch.stack(per_row).mean().item(), rel=1e-5)
    # evaluation: every catalog item scored, ranks in range
    ev = ds["test"][torch.arange(5)]
    out = net(ev["features"])
    assert out["catalog"].shape == (dm.num_items, 16)
    ranks = module.ranks(ev, out)
    assert ranks.shape == (5,) and int(ranks.max()) < dm.num_items


def test_sampled_softmax_loss_masks_collisions() -> None:
    out = {
        "hidden": torch.ones(1, 1, 2),
        "lengths": torch.tensor([1]),
        "target": torch.ones(1, 1, 2),
        "negatives": torch.zeros(1, 2, 2),
    }
    # negatives [5, 9]; the target is 5: only 9 competes -> log(e^2 + e^0) - 2
    got = sampled_softmax_loss(out, torch.tensor([[5]]), torch.tensor([[5, 9]]))
    assert got.item() == pytest.approx(math.log(math.exp(2) + 1) - 2)


def test_errors_name_the_bad_value() -> None:
    with pytest.raises(ValueError, match="max_len must be >= 1, got 0.*HINT"):
        MovieLensSequenceDataModule(max_len=0)
    with pytest.raises(ValueError, match="num_heads=3 must divide embedding_dim=16.*HINT"):
        SASRec(10, embedding_dim=16, num_heads=3)
    with pytest.raises(ValueError, match="one sparse feature.*HINT"):
        SequentialRecModule([])
    with pytest.raises(ValueError, match="a row's target is excluded"):
        target_rank(torch.zeros(1, 3), torch.tensor([1]), torch.tensor([[False, True, False]]))


@pytest.mark.dist
def test_hr_ndcg_on_two_ranks_equal_one_rank(tmp_path: Path) -> None:
    """2 processes (item table split column-wise over both) vs the same weights unsharded in this one process."""
    two = run_ranks(rank_metrics, 2, tmp_path, max_len=20, batch_size=100)
    assert two[0]["sharding"] == {"t_item": "column_wise"} and two[0]["shard_ranks"] == {"t_item": [0, 1]}
    assert two[0]["metrics"] == two[1]["metrics"]  # every rank logs the global value
    dm = MovieLensSequenceDataModule(str(movielens_dir()), download=False, max_len=20)
    model = seeded_model(dm, train_steps=16).eval()
    ds = {s: dm.split(s) for s in ("train", "val", "test")}
    one = {}
    with torch.no_grad():
        for stage in ("val", "test"):
            one[stage] = torch.cat([model.ranks(ds[stage][rows]) for rows in torch.arange(943).split(300)])
    m = RankingMetrics(ks=(10,), prefix="val/", hit_name="hr")
    m.update(one["val"])
    assert two[0]["metrics"] == pytest.approx({k: v.item() for k, v in m.compute().items()}, abs=1e-7)  # float32 log
    assert round(two[0]["metrics"]["val/hr@10"] * 943) == int((one["val"] < 10).sum()) >= 30  # hits, exactly
    by_user_two = {u: r for res in two for u, r in zip(res["users"], res["ranks"])}
    assert len(by_user_two) == 943  # every user once over the ranks
    assert [by_user_two[u] for u in ds["test"].users.tolist()] == one["test"].tolist()  # every user's rank


@pytest.mark.dist
def test_config_runs_with_the_cli(tmp_path: Path) -> None:
    from lightning_rec._cli import run

    movielens_dir()
    cli = run(
        [
            "fit",
            "--config",
            str(REPO / "examples/configs/movielens_sasrec.yaml"),
            "--trainer.devices=1",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=2",
            "--trainer.check_val_every_n_epoch=1",
            f"--data.init_args.data_dir={movielens_dir()}",
        ]
    )
    assert isinstance(cli.model, SequentialRecModule) and isinstance(cli.datamodule, MovieLensSequenceDataModule)
    assert cli.model.num_items == cli.datamodule.num_items == 1683  # linked from the DataModule
    plan = cli.trainer.strategy.sharding_plan.get_plan_for_module("model.item_ec")
    assert plan["t_item"].sharding_type == "row_wise"
    metrics = cli.trainer.callback_metrics
    assert {"train/loss", "val/hr@10", "val/ndcg@10"} <= set(metrics)
    assert 0.0 <= float(metrics["val/ndcg@10"]) <= float(metrics["val/hr@10"]) <= 1.0


@pytest.mark.dist
def test_trains_like_plain_pytorch_pipelined_and_resharded(tmp_path: Path) -> None:
    """The zoo harness (tests/helpers/zoo.py): 1 and 2 processes vs plain PyTorch, pipelined, 2 <-> 1, loaded."""
    movielens_dir()
    check_case(tmp_path, zoo_sequential)


# ------------------------------------------------------------------------------------------------------------
# What each rank runs (run_ranks imports it from this module), and the model it validates.
# ------------------------------------------------------------------------------------------------------------


def seeded_model(dm: MovieLensSequenceDataModule, seed: int = 0, train_steps: int = 0) -> SequentialRecModule:
    """A small SASRec module whose every weight is a function of ``seed`` and the data: the item table on CPU (the
    strategy keeps its rows), then ``train_steps`` plain-PyTorch Adam steps on the training split (unsharded,
    deterministic, identical on every rank), so that its rankings have hits to compare."""
    torch.manual_seed(seed)
    model = SequentialRecModule(
        [SparseFeature("item", dm.num_items)],
        embedding_dim=16,
        max_len=dm.max_len,
        num_blocks=1,
        num_heads=2,
        dropout=0.0,
    )
    configs = model.model.item_ec.embedding_configs()
    model.model.item_ec = EmbeddingCollection(tables=configs, device=torch.device("cpu"))
    weight = model.model.item_ec.embeddings[configs[0].name].weight
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    if train_steps:
        train = dm.split("train")
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        batches = torch.arange(len(train)).split(128)
        for step in range(train_steps):
            batch = train[(step // len(batches), batches[step % len(batches)])]
            optimizer.zero_grad()
            model.loss(batch, model(batch)).backward()
            optimizer.step()
    return model


def rank_metrics(
    rank: int,
    world_size: int,
    out_dir: Path,
    max_len: int = 20,
    batch_size: int = 100,
    train_steps: int = 16,
) -> dict[str, Any]:
    """Validate and predict (test split) one seeded model with the item table column-wise: the logged HR/NDCG and
    every user's rank, on this rank."""
    dm = MovieLensSequenceDataModule(str(MOVIELENS_DIR), download=False, max_len=max_len, batch_size=batch_size)
    model = seeded_model(dm, train_steps=train_steps)
    trainer = L.Trainer(
        strategy=RecShardStrategy(constraints={"t_item": {"sharding_types": ["column_wise"], "min_partition": 8}}),
        accelerator="cpu",
        devices=world_size,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    metrics = trainer.validate(model, dm, verbose=False)[0]
    predictions = trainer.predict(model, dm)
    plan = trainer.strategy.sharding_plan.get_plan_for_module("model.item_ec")
    return {
        "metrics": metrics,
        "users": torch.cat([p["users"] for p in predictions]).tolist(),
        "ranks": torch.cat([p["rank"] for p in predictions]).tolist(),
        "sharding": {name: str(p.sharding_type) for name, p in plan.items()},
        "shard_ranks": {name: list(p.ranks or []) for name, p in plan.items()},
    }
