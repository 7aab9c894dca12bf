"""TopKMetrics against RecBole's own formulas (recbole/evaluator/metrics.py, transcribed in numpy below), the
hit-matrix builders (topk_hits as RecBole's collector, hits_from_ranks), input checks, and exactness across ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lightning_rec.metrics import TopKMetrics, hits_from_ranks, topk_hits
from tests.helpers.dist import run_ranks

KS = (1, 5, 10)


# ------------------------------------------------------------------------------------------------------------
# RecBole 1.2's metric_info functions (Recall, MRR, NDCG, Hit, Precision), as written there (np.float -> float),
# and TopkMetric.topk_result's mean over users; Collector.eval_batch_collect's "rec.topk" for the hit matrix.
# ------------------------------------------------------------------------------------------------------------


def recbole_metrics(pos_index: np.ndarray, pos_len: np.ndarray, ks: tuple[int, ...]) -> dict[str, float]:
    def hit(pos_index):
        return (np.cumsum(pos_index, axis=1) > 0).astype(int)

    def mrr(pos_index):
        idxs = pos_index.argmax(axis=1)
        result = np.zeros_like(pos_index, dtype=float)
        for row, idx in enumerate(idxs):
            if pos_index[row, idx] > 0:
                result[row, idx:] = 1 / (idx + 1)
            else:
                result[row, idx:] = 0
        return result

    def recall(pos_index, pos_len):
        return np.cumsum(pos_index, axis=1) / pos_len.reshape(-1, 1)

    def ndcg(pos_index, pos_len):
        len_rank = np.full_like(pos_len, pos_index.shape[1])
        idcg_len = np.where(pos_len > len_rank, len_rank, pos_len)
        iranks = np.zeros_like(pos_index, dtype=float)
        iranks[:, :] = np.arange(1, pos_index.shape[1] + 1)
        idcg = np.cumsum(1.0 / np.log2(iranks + 1), axis=1)
        for row, idx in enumerate(idcg_len):
            idcg[row, idx:] = idcg[row, idx - 1]
        ranks = np.zeros_like(pos_index, dtype=float)
        ranks[:, :] = np.arange(1, pos_index.shape[1] + 1)
        dcg = 1.0 / np.log2(ranks + 1)
        dcg = np.cumsum(np.where(pos_index, dcg, 0), axis=1)
        return dcg / idcg

    def precision(pos_index):
        return pos_index.cumsum(axis=1) / np.arange(1, pos_index.shape[1] + 1)

    values = {
        "recall": recall(pos_index, pos_len),
        "mrr": mrr(pos_index),
        "ndcg": ndcg(pos_index, pos_len),
        "hit": hit(pos_index),
        "precision": precision(pos_index),
    }
    return {f"{name}@{k}": float(v.mean(axis=0)[k - 1]) for name, v in values.items() for k in ks}


def recbole_topk(scores: torch.Tensor, positives: list[list[int]], history: list[list[int]], k: int):
    """Trainer._full_sort_batch_eval (column 0 and the history to -inf) + Collector's "rec.topk" matrix."""
    scores = scores.clone()
    scores[:, 0] = -np.inf
    for row, items in enumerate(history):
        scores[row, items] = -np.inf
    _, topk_idx = torch.topk(scores, k, dim=-1)
    pos_matrix = torch.zeros_like(scores, dtype=torch.int)
    for row, items in enumerate(positives):
        pos_matrix[row, items] = 1
    return torch.gather(pos_matrix, 1, topk_idx).bool().numpy(), pos_matrix.sum(1).numpy()


def random_case(queries: int, items: int, seed: int):
    """Scores with some signal, 1..30 positives per query (several beyond k), a history per query, never overlapping."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    positives, history = [], []
    affinity = torch.randn(queries, items, generator=g)
    for q in range(queries):
        chosen = rng.permutation(np.arange(1, items))[: int(rng.integers(1, 31)) + int(rng.integers(0, 40))]
        n_pos = int(rng.integers(1, min(30, len(chosen)) + 1))
        positives.append(sorted(chosen[:n_pos].tolist()))
        history.append(sorted(chosen[n_pos:].tolist()))
        affinity[q, positives[-1]] += 1.5  # positives tend to rank high, so every metric is far from 0
    return affinity, positives, history


def flat(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([v for r in lists for v in r], dtype=torch.long), torch.tensor([len(r) for r in lists])


def values(metric: TopKMetrics) -> dict[str, float]:
    return {k: float(v) for k, v in metric.compute().items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_recbole_on_random_full_rankings(seed: int) -> None:
    scores, positives, history = random_case(queries=300, items=400, seed=seed)
    pos_index, pos_len = recbole_topk(scores, positives, history, k=max(KS))
    expected = recbole_metrics(pos_index, pos_len, KS)
    assert min(expected.values()) > 0.02 and max(expected.values()) < 0.99, "a case where every metric says something"

    metric = TopKMetrics(KS, prefix="test/")
    pos_ids, pos_lengths = flat(positives)
    excl_ids, excl_lengths = flat([[0] + h for h in history])
    for chunk in torch.arange(len(positives)).split(64):  # several updates
        rows = chunk.tolist()
        p_ids, p_len = flat([positives[r] for r in rows])
        e_ids, e_len = flat([[0] + history[r] for r in rows])
        hits, n = topk_hits(scores[chunk], p_ids, p_len, max(KS), e_ids, e_len)
        metric.update(hits, n)
    assert values(metric) == pytest.approx({f"test/{k}": v for k, v in expected.items()}, rel=1e-12, abs=1e-12)
    # the builder alone is RecBole's matrix
    hits, n = topk_hits(scores, pos_ids, pos_lengths, max(KS), excl_ids, excl_lengths)
    assert np.array_equal(hits.numpy(), pos_index) and np.array_equal(n.numpy(), pos_len)


def test_ranks_give_the_same_hit_matrix_as_scores() -> None:
    scores, positives, history = random_case(queries=50, items=120, seed=3)
    pos_index, pos_len = recbole_topk(scores, positives, history, k=10)
    masked = scores.clone()
    masked[:, 0] = -np.inf
    for row, items in enumerate(history):
        masked[row, items] = -np.inf
    order = masked.argsort(dim=1, descending=True, stable=True)
    place = torch.empty_like(order)
    place.scatter_(1, order, torch.arange(scores.shape[1]).expand_as(order).contiguous())
    ranks = torch.cat([place[row, items] for row, items in enumerate(positives)])
    hits, n = hits_from_ranks(ranks, 10, lengths=torch.tensor([len(p) for p in positives]))
    assert np.array_equal(hits.numpy(), pos_index) and np.array_equal(n.numpy(), pos_len)
    single, ones = hits_from_ranks(torch.tensor([0, 9, 10, 500]), 10)
    assert single.int().argmax(1).tolist() == [0, 9, 0, 0] and single.sum(1).tolist() == [1, 1, 0, 0]
    assert ones.tolist() == [1, 1, 1, 1]


def test_single_positive_matches_hand_values() -> None:
    """One positive per query: recall = hit, MRR = 1/(rank+1), NDCG = 1/log2(rank+2), precision = hit/k."""
    metric = TopKMetrics((10,))
    metric.update(*hits_from_ranks(torch.tensor([0, 3, 20]), 10))
    got = values(metric)
    assert got["recall@10"] == pytest.approx(2 / 3) and got["hit@10"] == pytest.approx(2 / 3)
    assert got["mrr@10"] == pytest.approx((1 + 1 / 4) / 3)
    assert got["ndcg@10"] == pytest.approx((1 + 1 / np.log2(5)) / 3)
    assert got["precision@10"] == pytest.approx(2 / 30)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="ks must be distinct"):
        TopKMetrics(ks=(10, 10))
    with pytest.raises(ValueError, match="metrics must be distinct names among recall"):
        TopKMetrics(metrics=("recal",))
    metric = TopKMetrics((10,))
    with pytest.raises(ValueError, match=r"K >= max\(ks\) = 10"):
        metric.update(torch.zeros(2, 5, dtype=torch.bool), torch.ones(2))
    with pytest.raises(ValueError, match="at least one positive"):
        metric.update(torch.zeros(2, 10, dtype=torch.bool), torch.tensor([1, 0]))
    assert float(metric.count) == 0, "a refused batch leaves the state as it was"
    only = TopKMetrics((5,), prefix="val/", metrics=("mrr",))
    only.update(*hits_from_ranks(torch.tensor([2]), 5))
    assert values(only) == {"val/mrr@5": pytest.approx(1 / 3)}


@pytest.mark.dist
def test_two_processes_equal_one_process(tmp_path: Path) -> None:
    scores, positives, history = random_case(queries=301, items=200, seed=7)
    single = TopKMetrics(KS)
    single.update(*_hits(scores, positives, history, range(301)))
    expected = values(single)
    ranks = run_ranks(topk_ranks, world_size=2, out_dir=tmp_path)
    for r in ranks:
        assert r["metrics"] == pytest.approx(expected, rel=1e-12)
    assert [r["queries"] for r in ranks] == [100, 201]
    alone = TopKMetrics(KS)
    alone.update(*_hits(scores, positives, history, range(100)))
    assert values(alone) != pytest.approx(expected, abs=1e-4), "the sync is what makes them equal"


def _hits(scores, positives, history, rows) -> tuple[torch.Tensor, torch.Tensor]:
    rows = list(rows)
    p_ids, p_len = flat([positives[r] for r in rows])
    e_ids, e_len = flat([[0] + history[r] for r in rows])
    return topk_hits(scores[rows], p_ids, p_len, max(KS), e_ids, e_len)


def topk_ranks(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    """Rank 0 evaluates queries 0..99, rank 1 the other 201 (uneven), in chunks; compute() syncs."""
    dist.init_process_group("gloo")
    scores, positives, history = random_case(queries=301, items=200, seed=7)
    mine = range(0, 100) if rank == 0 else range(100, 301)
    metric = TopKMetrics(KS)
    for start in range(mine.start, mine.stop, 37):
        metric.update(*_hits(scores, positives, history, range(start, min(start + 37, mine.stop))))
    result = {"metrics": values(metric), "queries": len(mine)}
    dist.destroy_process_group()
    return result
