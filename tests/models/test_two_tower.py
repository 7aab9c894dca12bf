"""The two-tower retrieval model (issue 15): the leave-one-out data, ranking metrics against brute force, the
gathered in-batch softmax, exact metrics on 2 ranks, either tower used alone, the shipped config through the CLI,
and (zoo harness) training like plain PyTorch on 1 and 2 processes, pipelined and resharded."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_rec import RecShardStrategy
from lightning_rec._cli import run
from lightning_rec.data.movielens import load_interactions
from lightning_rec.data.movielens_retrieval import (
    CANDIDATE_FEATURES,
    QUERY_FEATURES,
    MovieLensRetrievalDataModule,
    RetrievalSplits,
    popularity_baseline,
    retrieval_splits,
)
from lightning_rec.metrics import RankingMetrics, target_rank
from lightning_rec.models import TwoTowerModule
from lightning_rec.models.two_tower import build_two_tower, in_batch_softmax_loss
from tests.helpers import zoo_two_tower
from tests.helpers.data import REPO, movielens_dir
from tests.helpers.dist import run_ranks
from tests.helpers.zoo import check_case, seeded_module
from tests.helpers.zoo_two_tower import CASE


@pytest.fixture(scope="module")
def interactions():
    return load_interactions(movielens_dir())


@pytest.fixture(scope="module")
def splits(interactions) -> RetrievalSplits:
    return retrieval_splits(interactions, history_length=5)


def _brute_sequences(it, threshold: float = 4.0) -> dict[int, list[int]]:
    """Each user's positives by (timestamp, file position), from the raw columns, one rating at a time."""
    rows: dict[int, list] = {}
    for pos, (u, i, r, t) in enumerate(
        zip(it.user.tolist(), it.item.tolist(), it.rating.tolist(), it.timestamp.tolist())
    ):
        if r >= threshold:
            rows.setdefault(u, []).append((t, pos, i))
    return {u: [i for _, _, i in sorted(rows[u])] for u in sorted(rows)}


def _jagged_rows(jagged) -> list[list]:
    return [jagged.values[a:b].tolist() for a, b in zip(jagged.offsets[:-1].tolist(), jagged.offsets[1:].tolist())]


# ---------------------------------------------------------------------------------------------------------
# Data: leave-one-out split
# ---------------------------------------------------------------------------------------------------------


def test_leave_one_out_holds_out_each_users_last_two_positives(interactions, splits) -> None:
    seqs = _brute_sequences(interactions)
    assert splits.sequences == seqs
    evaluated = sorted(u for u, s in seqs.items() if len(s) >= 3)
    assert len(evaluated) == 942 and len(splits.val) == len(splits.test) == 942
    assert splits.val.user.tolist() == evaluated and splits.test.user.tolist() == evaluated
    assert splits.val.item.tolist() == [seqs[u][-2] for u in evaluated]
    assert splits.test.item.tolist() == [seqs[u][-1] for u in evaluated]
    # every positive is used exactly once: training pairs + one val + one test per evaluated user
    n_pos = int((interactions.rating >= 4).sum())
    assert len(splits.train) + 2 * len(evaluated) == n_pos == 55375
    expected_train = [(u, i) for u, s in seqs.items() for i in (s[:-2] if len(s) >= 3 else s)]
    assert list(zip(splits.train.user.tolist(), splits.train.item.tolist())) == expected_train
    # histories: the newest <= 5 earlier positives, time-ordered; weights are stars / 5
    hist = _jagged_rows(splits.train.history)
    k = 0
    for s in seqs.values():
        for t in range(len(s) - 2 if len(s) >= 3 else len(s)):
            assert hist[k] == s[max(0, t - 5) : t]
            k += 1
    stars = {
        (u, i): r
        for u, i, r in zip(interactions.user.tolist(), interactions.item.tolist(), interactions.rating.tolist())
    }
    w = _jagged_rows(splits.train.history_weight)
    assert all(
        wt == pytest.approx([stars[(u, i)] / 5 for i in h]) for u, h, wt in zip(splits.train.user.tolist(), hist, w)
    )
    # evaluation: history ends right before the target; exclusions are id 0 + every earlier positive (val joins at test)
    for rows, back in ((splits.val, 2), (splits.test, 1)):
        for u, h, ex in zip(rows.user.tolist(), _jagged_rows(rows.history), _jagged_rows(rows.exclude)):
            s = seqs[u]
            assert h == s[: len(s) - back][-5:]
            assert ex == [0] + s[: len(s) - back] and s[-back] not in ex


def test_batches_and_features(splits) -> None:
    batch = splits.train[torch.tensor([3, 0, 7])]
    q, c = batch["query"], batch["candidate"]
    assert q.keys() == list(QUERY_FEATURES) and c.keys() == list(CANDIDATE_FEATURES)
    assert c["item_id"].values().tolist() == splits.train.item[[3, 0, 7]].tolist()
    hist = _jagged_rows(splits.train.history)
    assert [h.tolist() for h in q["history"].to_dense()] == [hist[3], hist[0], hist[7]]
    assert [h.tolist() for h in q["last_item"].to_dense()] == [hist[i][-1:] for i in (3, 0, 7)]
    assert q["user_id"].weights().tolist() == [1.0, 1.0, 1.0] and q.weights().numel() == q.values().numel()
    counts = torch.bincount(splits.train.item, minlength=splits.num_items).double()
    expected_log_q = torch.log(counts[splits.train.item[[3, 0, 7]]] / counts.sum()).float()
    assert torch.allclose(batch["candidate_log_q"], expected_log_q)
    ev = splits.test[torch.tensor([1, 2])]
    assert ev["candidate"]["item_id"].values().tolist() == list(range(splits.num_items))
    assert ev["exclude_lengths"].tolist() == [len(r) for r in _jagged_rows(splits.test.exclude)[1:3]]


def test_datamodule_publishes_features_and_refuses_bad_arguments() -> None:
    dm = MovieLensRetrievalDataModule(str(movielens_dir()), download=False)
    names = [f.name for f in dm.sparse_features]
    assert names == [*QUERY_FEATURES, *CANDIDATE_FEATURES] and dm.num_dense_features == 0
    sizes = {f.name: f.num_embeddings for f in dm.sparse_features}
    assert sizes["history"] == sizes["last_item"] == sizes["item_id"] == 1683
    with pytest.raises(ValueError, match=r"min_positives must be >= 3.*got 2.*HINT"):
        MovieLensRetrievalDataModule(min_positives=2)
    with pytest.raises(ValueError, match=r"history_weights.*'often'.*HINT"):
        MovieLensRetrievalDataModule(history_weights="often")
    with pytest.raises(ValueError, match=r"unknown split 'dev'.*HINT"):
        dm.split("dev")


def test_recency_weights(interactions) -> None:
    s = retrieval_splits(interactions, history_length=3, history_weights="recency", history_decay=0.5)
    w = _jagged_rows(s.train.history_weight)
    assert w[:4] == [[], [1.0], [0.5, 1.0], [0.25, 0.5, 1.0]]


# ---------------------------------------------------------------------------------------------------------
# Metrics and the popularity baseline against brute force
# ---------------------------------------------------------------------------------------------------------


def _brute_rank(scores: np.ndarray, target: int, exclude: np.ndarray) -> int:
    keep = np.flatnonzero(~exclude)
    order = keep[np.argsort(-scores[keep], kind="stable")]
    return int(np.flatnonzero(order == target)[0])


def test_target_rank_and_ranking_metrics_against_numpy() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (200, 30), generator=g).double()  # many ties
    target = torch.randint(0, 30, (200,), generator=g)
    exclude = torch.rand(200, 30, generator=g) < 0.3
    exclude[torch.arange(200), target] = False
    ranks = target_rank(scores, target, exclude)
    expected = [_brute_rank(s, t, e) for s, t, e in zip(scores.numpy(), target.tolist(), exclude.numpy())]
    assert ranks.tolist() == expected
    m = RankingMetrics(ks=(1, 5, 10), prefix="x/")
    m.update(ranks[:77])
    m.update(ranks[77:])
    out = {k: float(v) for k, v in m.compute().items()}
    for k in (1, 5, 10):
        assert out[f"x/recall@{k}"] == sum(r < k for r in expected) / 200
        assert out[f"x/ndcg@{k}"] == pytest.approx(
            sum(1 / math.log2(r + 2) for r in expected if r < k) / 200, abs=1e-15
        )
    with pytest.raises(ValueError, match=r"target is excluded.*HINT"):
        target_rank(scores[:1], target[:1], torch.ones(1, 30, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"ks must be distinct.*\[0\].*HINT"):
        RankingMetrics(ks=[0])


def test_popularity_baseline_against_brute_force(splits) -> None:
    counts = np.bincount(splits.train.item.numpy(), minlength=splits.num_items).astype(float)
    ranks = [
        _brute_rank(counts, t, np.isin(np.arange(splits.num_items), ex))
        for t, ex in zip(splits.test.item.tolist(), _jagged_rows(splits.test.exclude))
    ]
    out = popularity_baseline(splits, "test", ks=(10, 50))
    assert out["test/recall@10"] == sum(r < 10 for r in ranks) / 942
    assert out["test/recall@50"] == sum(r < 50 for r in ranks) / 942
    assert out["test/ndcg@10"] == pytest.approx(sum(1 / math.log2(r + 2) for r in ranks if r < 10) / 942, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------
# The model: in-batch softmax, towers
# ---------------------------------------------------------------------------------------------------------


def test_in_batch_softmax_masks_repeats_and_corrects_for_popularity() -> None:
    x = softmax_inputs()
    loss = in_batch_softmax_loss(x["q"], x["c"], x["ids"], temperature=0.5, log_q=x["log_q"])
    expected = 0.0
    ids = x["ids"].tolist()
    for i in range(7):
        logits = [(x["q"][i] @ x["c"][j]).item() / 0.5 - x["log_q"][j].item() for j in range(7)]
        kept = [l for j, l in enumerate(logits) if j == i or ids[j] != ids[i]]  # repeats of item i are not negatives
        expected += -logits[i] + math.log(sum(math.exp(l) for l in kept))
    assert loss.item() == pytest.approx(expected / 7, abs=1e-6)
    unmasked = in_batch_softmax_loss(x["q"], x["c"], x["ids"], temperature=0.5, mask_duplicates=False)
    assert unmasked.item() == pytest.approx(F.cross_entropy(x["q"] @ x["c"].T / 0.5, torch.arange(7)).item(), abs=1e-6)
    with pytest.raises(ValueError, match=r"temperature must be > 0, got 0.*HINT"):
        in_batch_softmax_loss(x["q"], x["c"], x["ids"], temperature=0)


def test_two_tower_tables_weighted_shared_and_towers_alone(splits) -> None:
    module = seeded_module(CASE)
    q_ebc, c_ebc = module.model.query_tower.ebc, module.model.candidate_tower.ebc
    assert q_ebc.is_weighted() and not c_ebc.is_weighted()
    shared = [t for t in q_ebc.embedding_bag_configs() if len(t.feature_names) > 1]
    assert [(t.name, t.feature_names, t.num_embeddings) for t in shared] == [
        ("t_history", ["history", "last_item"], 1683)
    ]
    batch = splits.train[torch.arange(6)]
    with torch.no_grad():
        q, c = module(batch)
        assert torch.equal(module.model.query_tower(batch["query"]), q)
        assert torch.equal(module.model.candidate_tower(batch["candidate"]), c)
        assert torch.allclose(q.norm(dim=1), torch.ones(6)) and q.shape == (6, 8)
        # the weights count: history weights scaled by 2 change the query embedding of rows that have a history
        kjt = batch["query"]
        doubled = type(kjt).from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths(), weights=kjt.weights() * 2)
        moved = (module.model.query_tower(doubled) - q).abs().sum(1)
        assert (moved[batch["query"]["history"].lengths() > 0] > 1e-4).all()
    with pytest.raises(ValueError, match=r"\['genre'\] are not among the sparse features.*HINT"):
        build_two_tower(
            MovieLensRetrievalDataModule(str(movielens_dir()), download=False).sparse_features,
            candidate_features=["item_id", "genre"],
        )
    with pytest.raises(ValueError, match=r"num_dense_features=2.*HINT"):
        TwoTowerModule(module.hparams.sparse_features, num_dense_features=2)


# ---------------------------------------------------------------------------------------------------------
# Several processes
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.dist
def test_metrics_on_two_ranks_equal_one_process_and_towers_work_alone_after_loading(tmp_path: Path, splits) -> None:
    two = run_ranks(evaluate, 2, tmp_path, data_dir=str(movielens_dir()))
    assert two[0]["world_size"] == 2 and two[0]["plan"]["t_user_id"] == two[0]["plan"]["t_history"] == "column_wise"
    assert two[0]["plan"]["t_item_id"] == "table_wise"
    # one process, plain PyTorch: the same seeded weights, unsharded, every query at once
    module = seeded_module(CASE).eval()
    full = retrieval_splits(load_interactions(movielens_dir()))
    expected: dict[str, float] = {}
    with torch.no_grad():
        for name, rows in (("val", full.val), ("test", full.test)):
            _, ranks = module.rank_targets(rows[torch.arange(len(rows))])
            m = RankingMetrics((10, 50), prefix=f"{name}/")
            m.update(ranks)
            expected.update({k: float(v) for k, v in m.compute().items()})
            if name == "test":
                test_ranks = ranks.tolist()
    for r in two:
        for key, value in expected.items():
            assert r[key] == pytest.approx(value, abs=1e-12), key
    assert sum(r < 10 for r in test_ranks) > 0, "the seeded model must hit something, or the check is vacuous"
    # every test query's rank, over both ranks' predictions in rank order, equals the one-process rank
    assert two[0]["target"] + two[1]["target"] == full.test.item.tolist()
    assert two[0]["rank"] + two[1]["rank"] == test_ranks

    # The 2-process checkpoint loads unsharded; its query tower alone gives the embeddings the sharded model used.
    loaded = TwoTowerModule.load_from_checkpoint(tmp_path / "ckpt").eval()
    with torch.no_grad():
        alone = loaded.model.query_tower(full.test.query(torch.arange(len(full.test))))
        items = loaded.model.candidate_tower(full.test.candidate(torch.arange(full.num_items)))
        _, ranks_alone = loaded.rank_targets(full.test[torch.arange(len(full.test))])
    assert torch.allclose(alone, torch.tensor(two[0]["query"] + two[1]["query"]), atol=1e-6)
    assert items.shape == (1683, 8) and torch.allclose(items.norm(dim=1), torch.ones(1683))
    assert ranks_alone.tolist() == test_ranks

    # The gathered softmax with batches of 4 and 3 rows: the mean of the ranks' losses is the whole batch's loss,
    # and each rank's input gradients are world_size x the whole-batch gradients of its rows.
    x = softmax_inputs()
    q, c = x["q"].clone().requires_grad_(True), x["c"].clone().requires_grad_(True)
    loss = in_batch_softmax_loss(q, c, x["ids"], temperature=0.5, log_q=x["log_q"])
    loss.backward()
    assert (two[0]["softmax"]["loss"] + two[1]["softmax"]["loss"]) / 2 == pytest.approx(loss.item(), abs=1e-6)
    for rank, r in enumerate(two):
        rows = rank_rows(7, rank, 2)
        assert torch.allclose(torch.tensor(r["softmax"]["q_grad"]), 2 * q.grad[rows], atol=1e-6)
        assert torch.allclose(torch.tensor(r["softmax"]["c_grad"]), 2 * c.grad[rows], atol=1e-6)


@pytest.mark.dist
def test_trains_like_plain_pytorch_pipelined_and_resharded(tmp_path: Path) -> None:
    check_case(tmp_path, zoo_two_tower)


@pytest.mark.dist
def test_shipped_config_trains_through_the_cli(tmp_path: Path) -> None:
    cli = run(
        [
            "fit",
            "--config",
            str(REPO / "examples/configs/movielens_two_tower.yaml"),
            "--trainer.devices=1",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=3",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
        ]
    )
    model = cli.model
    assert isinstance(model, TwoTowerModule) and not model.automatic_optimization
    assert [f.name for f in model.hparams.sparse_features] == [*QUERY_FEATURES, *CANDIDATE_FEATURES]
    assert cli.trainer.global_step == 3  # one step per batch, though two optimizers step
    assert {"val/recall@10", "val/ndcg@10", "val/recall@50", "val/ndcg@50", "train/loss"} <= set(
        cli.trainer.callback_metrics
    )
    constraints = cli.trainer.strategy.sharding.constraints
    assert constraints["t_user_id"].sharding_types == ["column_wise"] and "t_history" in constraints


# ------------------------------------------------------------------------------------------------------------
# What each rank runs (run_ranks imports it from this module), and the softmax inputs the tests share with it.
# ------------------------------------------------------------------------------------------------------------

# Real sharding on 2 ranks, column-wise included (evaluation only: no optimizer state to differ).
EVAL_PLAN = {
    "t_user_id": {"sharding_types": ["column_wise"]},
    "t_history": {"sharding_types": ["column_wise"]},
    "t_item_id": {"sharding_types": ["table_wise"]},
    "t_genres": {"sharding_types": ["data_parallel"]},
}


def softmax_inputs(total: int = 7, dim: int = 4) -> dict[str, torch.Tensor]:
    """A fixed global batch for the gathered softmax: queries, candidates, item ids (with repeats), log q."""
    g = torch.Generator().manual_seed(3)
    return {
        "q": torch.nn.functional.normalize(torch.randn(total, dim, generator=g), dim=1),
        "c": torch.nn.functional.normalize(torch.randn(total, dim, generator=g), dim=1),
        "ids": torch.tensor([5, 2, 5, 9, 2, 1, 7])[:total],
        "log_q": -torch.rand(total, generator=g) * 3,
    }


def rank_rows(total: int, rank: int, world_size: int) -> slice:
    """Rank 0 takes one row more than rank 1 (batches of unequal sizes)."""
    if world_size == 1:
        return slice(0, total)
    first = total // 2 + 1
    return slice(0, first) if rank == 0 else slice(first, total)


def evaluate(rank: int, world_size: int, out_dir: Path, data_dir: str) -> dict[str, Any]:
    """Validate and test the zoo case's seeded two-tower model with real sharding; report the metrics, every test
    query's rank and embedding (predict), save a checkpoint; then the gathered softmax on batches of unequal sizes."""
    dm = MovieLensRetrievalDataModule(data_dir, download=False, eval_batch_size=300)
    module = seeded_module(CASE)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=RecShardStrategy(constraints=EVAL_PLAN),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    result: dict[str, Any] = {}
    trainer.validate(module, dm)
    result.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    trainer.test(module, dm)
    result.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    predictions = trainer.predict(module, dm)
    result["target"] = torch.cat([p["target"] for p in predictions]).tolist()
    result["rank"] = torch.cat([p["rank"] for p in predictions]).tolist()
    result["query"] = torch.cat([p["query"] for p in predictions]).tolist()
    trainer.save_checkpoint(out_dir / "ckpt")

    x = softmax_inputs()
    mine = rank_rows(x["q"].shape[0], rank, world_size)
    q = x["q"][mine].clone().requires_grad_(True)
    c = x["c"][mine].clone().requires_grad_(True)
    loss = in_batch_softmax_loss(q, c, x["ids"][mine], temperature=0.5, log_q=x["log_q"][mine])
    loss.backward()
    result["softmax"] = {"loss": float(loss), "q_grad": q.grad.tolist(), "c_grad": c.grad.tolist()}
    result["world_size"] = dist.get_world_size()
    result["plan"] = {
        table: str(p.sharding_type) for m in trainer.strategy.sharding_plan.plan.values() for table, p in m.items()
    }
    return result
