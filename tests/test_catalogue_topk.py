"""lightning_rec.retrieval.topk: the streaming exact top-k equals brute force (the full fp32 score matrix, exclusions
as -inf, torch.topk), ties broken by the lower id, on one rank and on two ranks with the item table row-wise."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_rec.metrics import TopKMetrics, topk_hits
from lightning_rec.retrieval import (
    ExactTopK,
    StreamingTopK,
    catalogue_topk,
    ebc_lookup,
    merge_topk,
    row_range,
    screen_error_bound,
)
from tests.helpers.dist import run_ranks


def dyadic(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Values on a 2^-9 grid in [-1, 1): 10 significant bits, so bf16 (8) rounds them, while a dot product of 16 of
    them (24 bits) is exact in float32: the brute-force fp32 matrix is then the exact score."""
    return torch.randint(-512, 512, shape, generator=g).float() / 512


def brute_force(q: torch.Tensor, items: torch.Tensor, k: int, ex_ids: torch.Tensor, ex_lengths: torch.Tensor):
    """RecBole's full ranking: the whole fp32 score matrix, excluded items at -inf, ``torch.topk``; and the same
    list with ties ordered by the lower id (a stable descending sort). Returns ``(scores, topk_values, ids)``."""
    scores = q.float() @ items.float().T
    scores[torch.repeat_interleave(torch.arange(q.shape[0]), ex_lengths), ex_ids] = -math.inf
    values = torch.topk(scores, k, dim=1).values
    ids = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return scores, values, ids


def stream(q: torch.Tensor, items: torch.Tensor, k: int, g: torch.Generator, **kwargs: Any) -> StreamingTopK:
    """The items added in chunks of random sizes, in a random order."""
    n = items.shape[0]
    cuts = sorted(set(torch.randint(1, n, (6,), generator=g).tolist()))
    bounds = list(zip([0, *cuts], [*cuts, n]))
    top = StreamingTopK(q, k, **kwargs)
    for i in torch.randperm(len(bounds), generator=g).tolist():
        a, b = bounds[i]
        top.add(items[a:b], first_id=a)
    return top


def exclusions(q: int, n: int, most: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.randint(0, most + 1, (q,), generator=g)
    return torch.randint(0, n, (int(lengths.sum()),), generator=g), lengths


def positives(q: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.randint(1, 6, (q,), generator=g)  # several per query
    return torch.randint(0, n, (int(lengths.sum()),), generator=g), lengths


@pytest.mark.parametrize(
    ("item_block", "query_block"),
    [(512, 24), (1000, 64)],  # 512: rows checked in 256-item segments; 1000: whole rows
)
def test_equals_brute_force_with_ties_and_exclusions(item_block: int, query_block: int) -> None:
    g = torch.Generator().manual_seed(item_block)
    q, n, d, k = 64, 5000, 16, 10
    queries, items = dyadic((q, d), g), dyadic((n, d), g)
    items[1000:1400] = items[3000:3400]  # equal rows: equal scores, ordered by the lower id
    ex_ids, ex_lengths = exclusions(q, n, 60, g)
    scores, values, ids = brute_force(queries, items, k, ex_ids, ex_lengths)
    assert torch.equal(scores[scores > -math.inf], (queries.double() @ items.double().T).float()[scores > -math.inf])

    top = stream(
        queries,
        items,
        k,
        g,
        exclude_ids=ex_ids,
        exclude_lengths=ex_lengths,
        item_block=item_block,
        query_block=query_block,
    ).result()

    assert torch.equal(top.scores.float(), values)  # torch.topk's values, whatever its order among ties
    assert torch.equal(top.item_ids, ids)  # ties: the lower id first
    tied = (values[:, :-1] == values[:, 1:]).sum()
    assert tied > 20, "the case must have ties inside the lists"
    pos_ids, pos_lengths = positives(q, n, g)
    pos_ids[:q] = ids[torch.arange(q), torch.randint(0, k, (q,), generator=g)][:q]  # some hits for the metrics
    ours, reference = TopKMetrics(ks=(1, 5, 10)), TopKMetrics(ks=(1, 5, 10))
    ours.update(*top.hits(pos_ids, pos_lengths))
    positive = torch.zeros(q, n, dtype=torch.bool)
    positive[torch.repeat_interleave(torch.arange(q), pos_lengths), pos_ids] = True
    reference.update(positive.gather(1, ids), positive.sum(1))
    assert ours.compute() == reference.compute()
    assert 0 < ours.compute()["recall@10"] < 1


def test_gaussian_embeddings_match_recbole_full_ranking() -> None:
    """Float embeddings (no exact ties): the ids equal RecBole's ``torch.topk`` over the fp32 matrix, and so do the
    metrics of ``metrics.topk_hits`` (RecBole's collector); the scores are float64 dot products."""
    g = torch.Generator().manual_seed(1)
    q, n, d, k = 50, 4000, 32, 20
    queries, items = torch.randn(q, d, generator=g), torch.randn(n, d, generator=g)
    ex_ids, ex_lengths = exclusions(q, n, 40, g)
    scores, values, _ = brute_force(queries, items, k, ex_ids, ex_lengths)
    top = stream(queries, items, k, g, exclude_ids=ex_ids, exclude_lengths=ex_lengths).result()
    assert torch.equal(top.item_ids, torch.topk(scores, k, dim=1).indices)
    exact = (queries.double() @ items.double().T).gather(1, top.item_ids)
    torch.testing.assert_close(top.scores, exact, rtol=1e-12, atol=1e-12)
    pos_ids, pos_lengths = positives(q, n, g)
    pos_ids[:q] = top.item_ids[:, 3]
    ours, recbole = TopKMetrics(ks=(5, 20)), TopKMetrics(ks=(5, 20))
    ours.update(*top.hits(pos_ids, pos_lengths))
    recbole.update(*topk_hits(scores, pos_ids, pos_lengths, k))
    assert ours.compute() == recbole.compute()


def test_near_duplicates_the_screen_cannot_tell_apart() -> None:
    """64 items that differ by less than bf16 resolves (the screen scores them all alike) and hold the top 10: the
    order comes from the exact rescore, and every one of them must pass the screen's margin to be rescored."""
    g = torch.Generator().manual_seed(4)
    q, n, d, k = 4, 3000, 16, 10
    queries = torch.randint(1, 3, (q, d), generator=g).float() / 2  # 0.5 or 1: the scores q.v are bf16 numbers
    items = dyadic((n, d), g) / 4
    cluster = torch.randperm(n, generator=g)[:64]
    items[cluster] = torch.randint(1, 3, (d,), generator=g).float() / 2
    items[cluster, 0] = 1 + torch.randperm(64, generator=g).float() * 2.0**-14  # all round to 1.0 in bf16
    ex_ids, ex_lengths = cluster[:3], torch.tensor([3, 0, 0, 0])  # query 0 loses three of them
    _, values, ids = brute_force(queries, items, k, ex_ids, ex_lengths)
    assert bool(torch.isin(ids, cluster).all())

    top = stream(queries, items, k, g, exclude_ids=ex_ids, exclude_lengths=ex_lengths, item_block=512).result()
    assert torch.equal(top.item_ids, ids) and torch.equal(top.scores.float(), values)


def test_fewer_items_left_than_k() -> None:
    g = torch.Generator().manual_seed(2)
    queries, items = dyadic((3, 16), g), dyadic((12, 16), g)
    ex_ids = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 5])  # query 0: 3 items left; query 2: 11
    ex_lengths = torch.tensor([9, 0, 1])
    top = stream(queries, items, 5, g, exclude_ids=ex_ids, exclude_lengths=ex_lengths, item_block=4).result()
    _, values, ids = brute_force(queries, items, 5, ex_ids, ex_lengths)
    assert top.item_ids[0, 3:].tolist() == [-1, -1] and top.scores[0, 3:].tolist() == [-math.inf, -math.inf]
    assert torch.equal(top.item_ids[0, :3], ids[0, :3]) and torch.equal(top.item_ids[1:], ids[1:])
    assert torch.equal(top.scores.float(), values)


def test_same_chunk_twice_counts_once_and_merge() -> None:
    g = torch.Generator().manual_seed(3)
    queries, items = dyadic((8, 16), g), dyadic((300, 16), g)
    twice = StreamingTopK(queries, 7)
    for a in (0, 100, 0, 200, 100):
        twice.add(items[a : a + 100], first_id=a)
    _, _, ids = brute_force(queries, items, 7, torch.empty(0, dtype=torch.long), torch.zeros(8, dtype=torch.long))
    assert torch.equal(twice.result().item_ids, ids)
    halves = []
    for a, b in ((0, 170), (170, 300)):
        part = StreamingTopK(queries, 7)
        part.add(items[a:b], first_id=a)
        halves.append(part.result())
    assert torch.equal(merge_topk(halves).item_ids, ids)


@pytest.mark.parametrize("dim", [8, 32, 1024])
def test_screen_error_within_the_stated_bound(dim: int) -> None:
    """torch's bf16 matrix product behaves as the bound assumes (inputs rounded to bf16, fp32 accumulation, one
    rounding of the result): inputs chosen so that the rounding errors all point the same way, and random ones."""
    g = torch.Generator().manual_seed(dim)
    worst = torch.full((4, dim), 1 + 2.0**-8 - 2.0**-20)  # rounds down to 1 in bf16: each input loses ~2^-8
    for q, c in ((worst, worst), (torch.randn(64, dim, generator=g), torch.randn(512, dim, generator=g))):
        screen = (q.bfloat16() @ c.bfloat16().T).double()
        exact = q.double() @ c.double().T
        bound = screen_error_bound(dim) * q.double().norm(dim=1, keepdim=True) * c.double().norm(dim=1)
        assert bool(((screen - exact).abs() <= bound).all()), float(((screen - exact).abs() / bound).max())
    assert float(((screen - exact).abs() / bound).max()) > 0  # the screen does round


def test_bad_input_is_refused_in_one_line() -> None:
    q = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"exclude_lengths must hold 4 counts"):
        StreamingTopK(q, 3, exclude_ids=torch.tensor([1, 2]), exclude_lengths=torch.tensor([1, 0, 0, 0]))
    with pytest.raises(ValueError, match=r"items must be a floating \(n, 8\) tensor"):
        StreamingTopK(q, 3).add(torch.randn(5, 7), first_id=0)
    bad = torch.randn(5, 8)
    bad[3, 1] = math.nan
    with pytest.raises(ValueError, match=r"items row 3 is not finite"):
        StreamingTopK(q, 3).add(bad, first_id=0)
    with pytest.raises(ValueError, match=r"k, query_block and item_block must be >= 1"):
        StreamingTopK(q, 0)


# ---------------------------------------------------------------------------------------------------------------
# Two ranks, the item table row-wise: each rank scores its own rows, the lists are merged
# ---------------------------------------------------------------------------------------------------------------

ROWS, DIM, QUERIES, K, CHUNK = 3001, 16, 40, 10, 300  # 1501 + 1500 rows: 6 and 5 lookups of 300 (one padded)


def case() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    table, queries = dyadic((ROWS, DIM), g), dyadic((QUERIES, DIM), g)
    table[10:40] = table[2000:2030]  # equal rows on the two ranks
    ex_ids, ex_lengths = exclusions(QUERIES, ROWS, 30, g)
    return {"table": table, "queries": queries, "ex_ids": ex_ids, "ex_lengths": ex_lengths}


def two_rank_topk(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    """A rank: the table row-wise in DMP, its own rows filled from the case, then catalogue_topk."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from lightning_rec import EBCSharder
    from lightning_rec.testing.reference import reference_dmp

    dist.init_process_group("gloo")
    c = case()
    holder = torch.nn.Module()
    holder.ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="item", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["item_id"])],
        device=torch.device("meta"),
    )
    sharder = EBCSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.0})
    ebc = reference_dmp(holder, [sharder], torch.device("cpu"), {"item": {"sharding_types": ["row_wise"]}}).module.ebc
    start, stop = row_range(ebc, "item")
    (shard,) = ebc.state_dict()["embedding_bags.item.weight"].local_shards()
    shard.tensor.copy_(c["table"][start:stop])  # only this rank's rows exist here
    with torch.no_grad():
        top = catalogue_topk(
            c["queries"],
            ebc_lookup(ebc, "item_id"),
            (start, stop),
            K,
            exclude_ids=c["ex_ids"],
            exclude_lengths=c["ex_lengths"],
            chunk_rows=CHUNK,
            item_block=128,
        )
    return {"rows": [start, stop], "ids": top.item_ids.tolist(), "scores": top.scores.tolist()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(two_rank_topk, 2, tmp_path_factory.mktemp("two_ranks"))


@pytest.mark.dist
def test_two_ranks_row_wise_equal_one_rank_and_brute_force(two_ranks: list[dict[str, Any]]) -> None:
    c = case()
    assert [r["rows"] for r in two_ranks] == [[0, 1501], [1501, ROWS]]  # each rank held half the rows
    one = catalogue_topk(
        c["queries"],
        lambda ids: c["table"][ids],
        (0, ROWS),
        K,
        exclude_ids=c["ex_ids"],
        exclude_lengths=c["ex_lengths"],
    )
    _, values, ids = brute_force(c["queries"], c["table"], K, c["ex_ids"], c["ex_lengths"])
    assert torch.equal(one.item_ids, ids) and torch.equal(one.scores.float(), values)
    for r in two_ranks:
        assert r["ids"] == one.item_ids.tolist()
        assert r["scores"] == one.scores.tolist()
    tops = ExactTopK(torch.tensor(two_ranks[0]["ids"]), torch.tensor(two_ranks[0]["scores"], dtype=torch.float64))
    assert bool(((tops.item_ids >= 10) & (tops.item_ids < 40)).any()), "the equal rows must reach the lists"
