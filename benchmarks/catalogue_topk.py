"""Exact top-k ranking metrics over a 10M-item catalogue on 2 ranks, in bounded memory (issue 48).

The candidate table (``--items`` rows x ``--dim``) is an ``EmbeddingBagCollection`` sharded **row-wise** over the ranks
by TorchRec's ``DistributedModelParallel`` (gloo; each rank holds ``items / ranks`` rows and is never sent the others).
Each rank looks its own rows up through the sharded module, chunk by chunk, and streams them through
:func:`lightning_rec.retrieval.catalogue_topk` (a bf16 screen with a proven error bound, every candidate that could
reach a query's k-th best rescored exactly); the ranks' ``(Q, k)`` lists are all-gathered and merged, and RecBole's
recall/MRR/NDCG/hit/precision@k come from :class:`lightning_rec.metrics.TopKMetrics`. No ``queries x items`` matrix
exists at any time (10k x 10M float32 would be 400 GB).

Before the ranks start, the launcher prints the **peak-RSS bound** each rank must stay under::

    bound per rank = 1.5 GiB (interpreter, torch, TorchRec, FBGEMM, gloo)
                   + the rank's table shard (rows x dim x 4 bytes)
                   + 0.5 GiB (lookup chunks, the bf16 copy of a chunk, screen blocks, the (Q, k) lists, exclusions)

and each rank's ``ru_maxrss`` (the kernel's peak RSS of the process) is checked against it, and their sum against
the total. The **baseline**, measured in the same run on the same ranks, is the plain streaming top-k: a float32
matrix product per chunk and ``torch.topk`` merged into the running list, run for ``--baseline-queries`` of the
queries over the *whole* catalogue; its throughput (query-item pairs per second) gives the speed ratio, and its
result must equal the exact top-k of those queries (a check at full scale).

    .venv/bin/python benchmarks/catalogue_topk.py                       # 10M items, 10k queries, d=32, 2 ranks
    .venv/bin/python benchmarks/catalogue_topk.py --items 1000000 --queries 2000     # a quick look

Synthetic data: item rows are uniform in [-1, 1) from a counter-based hash of (row, column), so any rank can make
any row without the others; each query has ``--positives`` positive items, and its vector is their sum (weights
1, 1/2, 1/4, ...) plus noise (so the metrics are not zero); ``--exclude`` random items per query are excluded (its
"training history").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3
FIXED_BYTES = int(1.5 * GIB)  # a rank with torch + TorchRec + FBGEMM imported and gloo up: ~0.8 GiB measured
WORKING_BYTES = int(0.5 * GIB)  # see the module docstring


def rss_bound(items: int, dim: int, ranks: int) -> int:
    """The peak RSS each rank must stay under (see the module docstring)."""
    return FIXED_BYTES + math.ceil(items / ranks) * dim * 4 + WORKING_BYTES


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic; the shifts are arithmetic, which is still a fixed
    function of ``x``)."""
    x = x ^ (x >> 30)
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
    x = x ^ (x >> 27)
    x = x * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ (x >> 31)


def synthetic_rows(ids: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
    """Rows ``ids`` of the synthetic catalogue: float32 uniform in [-1, 1) on a 2^-23 grid, a function of (seed,
    row, column) alone."""
    counter = ids.long().unsqueeze(1) * dim + torch.arange(dim) + seed * 0x51ED27
    bits = (_mix(counter) >> 16) & 0xFFFFFF  # not the top bits: the last xor-shift leaves the sign bit 0
    return bits.float() / 2.0**23 - 1.0


def _fill_shard(ebc: Any, table: str, dim: int, seed: int, start: int, chunk: int = 1 << 17) -> None:
    """Write the synthetic rows into this rank's shard of ``table`` (in place, without any other rank's rows)."""
    weight = ebc.state_dict()[f"embedding_bags.{table}.weight"]
    for shard in weight.local_shards():
        rows = shard.tensor
        for a in range(0, rows.shape[0], chunk):
            b = min(rows.shape[0], a + chunk)
            rows[a:b].copy_(synthetic_rows(torch.arange(start + a, start + b), dim, seed))


def workload(items: int, queries: int, dim: int, positives: int, exclude: int, seed: int) -> dict[str, torch.Tensor]:
    """The queries, their positives and their exclusions (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, items, (queries, positives), generator=g)
    weights = 0.5 ** torch.arange(positives, dtype=torch.float32)  # the first positive leads, the others follow
    vectors = (synthetic_rows(pos.reshape(-1), dim, seed).view(queries, positives, dim) * weights[:, None]).sum(1)
    vectors += 0.1 * torch.randn(queries, dim, generator=g)
    return {
        "queries": vectors,
        "positive_ids": pos.reshape(-1),
        "positive_lengths": torch.full((queries,), positives),
        "exclude_ids": torch.randint(0, items, (queries * exclude,), generator=g),
        "exclude_lengths": torch.full((queries,), exclude),
    }


def baseline_topk(
    queries: torch.Tensor,
    lookup: Any,
    rows: tuple[int, int],
    k: int,
    ex_ids: torch.Tensor,
    ex_lengths: torch.Tensor,
    chunk_rows: int,
    block: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain streaming top-k: float32 scores of each chunk, exclusions set to -inf, ``torch.topk`` of the running
    list and the chunk (this rank's rows; the caller merges ranks). Returns ``(scores, ids)``."""
    import torch.distributed as dist

    q = queries.shape[0]
    best_s = torch.full((q, k), -math.inf)
    best_i = torch.full((q, k), -1, dtype=torch.long)
    ex_rows = torch.repeat_interleave(torch.arange(q), ex_lengths)
    start, stop = rows
    chunks = torch.tensor([math.ceil((stop - start) / chunk_rows)])
    dist.all_reduce(chunks, op=dist.ReduceOp.MAX)
    for i in range(int(chunks)):
        a = min(stop, start + i * chunk_rows)
        b = min(stop, a + chunk_rows)
        ids = torch.arange(a, b)
        emb = lookup(torch.cat([ids, torch.full((chunk_rows - (b - a),), start)]))[: b - a]
        for c0 in range(0, b - a, block):
            c1 = min(b - a, c0 + block)
            scores = queries @ emb[c0:c1].T
            inside = (ex_ids >= a + c0) & (ex_ids < a + c1)
            scores[ex_rows[inside], ex_ids[inside] - a - c0] = -math.inf
            s, j = torch.cat([best_s, scores], 1).topk(k, dim=1)
            best_i = torch.cat([best_i, torch.arange(a + c0, a + c1).expand(q, -1)], 1).gather(1, j)
            best_s = s
    return best_s, best_i


def rank_main(rank: int, world_size: int, out_dir: str, **cfg: Any) -> dict[str, Any]:
    """One rank: shard the table, fill its rows, evaluate, run the baseline, report times and peak RSS."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from lightning_rec import EBCSharder
    from lightning_rec.metrics import TopKMetrics
    from lightning_rec.retrieval import ExactTopK, catalogue_topk, ebc_lookup, merge_topk, row_range
    from lightning_rec.testing.reference import reference_dmp

    torch.set_num_threads(1)  # one core per rank (2 ranks on the 2-core machine)
    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    items, dim, k, seed = cfg["items"], cfg["dim"], cfg["k"], cfg["seed"]
    holder = torch.nn.Module()
    holder.ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="item", embedding_dim=dim, num_embeddings=items, feature_names=["item_id"])],
        device=torch.device("meta"),
    )
    sharder = EBCSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.0})
    dmp = reference_dmp(holder, [sharder], torch.device("cpu"), {"item": {"sharding_types": ["row_wise"]}})
    ebc = dmp.module.ebc
    rows = row_range(ebc, "item")
    _fill_shard(ebc, "item", dim, seed, rows[0])
    lookup = ebc_lookup(ebc, "item_id")
    with torch.no_grad():
        probe = lookup(torch.full((cfg["chunk_rows"],), rows[0]))[0]
    assert torch.equal(probe, synthetic_rows(torch.tensor([rows[0]]), dim, seed)[0]), "the shard was not filled"
    w = workload(items, cfg["queries"], dim, cfg["positives"], cfg["exclude"], seed)
    dist.barrier()
    t1, cpu1 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        top = catalogue_topk(
            w["queries"],
            lookup,
            rows,
            k,
            exclude_ids=w["exclude_ids"],
            exclude_lengths=w["exclude_lengths"],
            chunk_rows=cfg["chunk_rows"],
        )
    metrics = TopKMetrics(ks=(k,), prefix="test/")
    metrics.update(*top.hits(w["positive_ids"], w["positive_lengths"]))
    values = {name: float(v) for name, v in metrics.compute().items()}
    t2, cpu2 = time.perf_counter(), time.process_time()

    # The baseline on the first baseline_queries queries, over the whole catalogue (every rank its rows, merged).
    nb = cfg["baseline_queries"]
    lengths = w["exclude_lengths"][:nb]
    ex_ids = w["exclude_ids"][: int(lengths.sum())]
    dist.barrier()
    t3, cpu3 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        base_s, base_i = baseline_topk(w["queries"][:nb], lookup, rows, k, ex_ids, lengths, cfg["chunk_rows"])
    t4, cpu4 = time.perf_counter(), time.process_time()
    parts_s = [torch.empty_like(base_s) for _ in range(world_size)]
    parts_i = [torch.empty_like(base_i) for _ in range(world_size)]
    dist.all_gather(parts_s, base_s)
    dist.all_gather(parts_i, base_i)
    base = merge_topk([ExactTopK(i, s.double()) for s, i in zip(parts_s, parts_i)], k)
    exact_ids = top.item_ids[:nb]
    # Equal up to ties and float32's own rounding: same item where the two orders agree, else equal exact scores.
    same = base.item_ids == exact_ids
    exact_s = top.scores[:nb]
    mismatch = int((~same & ((base.scores - exact_s).abs() > 1e-5 * exact_s.abs().clamp(min=1))).sum())
    dist.destroy_process_group()
    return {
        "rank": rank,
        "rows": list(rows),
        "setup_s": t1 - t0,
        "eval_s": t2 - t1,
        "eval_cpu_s": cpu2 - cpu1,
        "baseline_s": t4 - t3,
        "baseline_cpu_s": cpu4 - cpu3,
        "pairs": cfg["queries"] * (rows[1] - rows[0]),
        "baseline_pairs": nb * (rows[1] - rows[0]),
        "metrics": values,
        "baseline_mismatches": mismatch,
        "baseline_same_ids": int(same.sum()),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=10_000_000)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=32, help="the zoo's two-tower embedding size (configs/two_tower)")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--positives", type=int, default=3)
    parser.add_argument("--exclude", type=int, default=20)
    parser.add_argument("--chunk-rows", type=int, default=65536)
    parser.add_argument("--baseline-queries", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()
    from lightning_rec.testing.launch import run_ranks

    bound = rss_bound(args.items, args.dim, args.devices)
    print(
        f"catalogue: {args.items:,} items x {args.dim} (row-wise over {args.devices} ranks), {args.queries:,} queries, "
        f"k={args.k}; a queries x items float32 matrix would be {args.queries * args.items * 4 / GIB:,.0f} GiB",
        flush=True,
    )
    print(
        f"peak-RSS bound, stated before the run: {bound / GIB:.2f} GiB per rank, {args.devices * bound / GIB:.2f} GiB "
        "in all",
        flush=True,
    )
    cfg = {k: v for k, v in vars(args).items() if k not in ("devices", "json")}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(
            "benchmarks.catalogue_topk:rank_main",
            args.devices,
            Path(tmp),
            timeout=1800,
            pythonpath=[str(REPO)],
            fresh=True,  # each rank's own peak RSS, not a forked zygote's pages
            **cfg,
        )
    wall = time.perf_counter() - start
    eval_s = max(r["eval_s"] for r in ranks)
    eval_cpu_s = max(r["eval_cpu_s"] for r in ranks)
    rate = sum(r["pairs"] for r in ranks) / eval_cpu_s
    base_rate = sum(r["baseline_pairs"] for r in ranks) / max(r["baseline_cpu_s"] for r in ranks)
    summary = {
        "items": args.items,
        "queries": args.queries,
        "dim": args.dim,
        "k": args.k,
        "ranks": args.devices,
        "load_average_1min": os.getloadavg()[0],
        "eval_s": eval_s,
        "eval_cpu_s": eval_cpu_s,
        "setup_s": max(r["setup_s"] for r in ranks),
        "wall_s": wall,
        "pairs_per_s": rate,
        "baseline_pairs_per_s": base_rate,
        "speedup_vs_fp32_chunked": rate / base_rate,
        "baseline_eval_cpu_s_extrapolated": sum(r["pairs"] for r in ranks) / base_rate,
        "baseline_mismatches": ranks[0]["baseline_mismatches"],
        "peak_rss_gib": [r["peak_rss"] / GIB for r in ranks],
        "rss_bound_gib": bound / GIB,
        "metrics": ranks[0]["metrics"],
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    failures = []
    if any(r["peak_rss"] > bound for r in ranks):
        failures.append(f"a rank's peak RSS exceeded the bound {bound / GIB:.2f} GiB: {summary['peak_rss_gib']}")
    if sum(r["peak_rss"] for r in ranks) > args.devices * bound:
        failures.append("the ranks' total peak RSS exceeded the total bound")
    if summary["baseline_mismatches"]:
        failures.append(f"{summary['baseline_mismatches']} places differ from the fp32 baseline beyond ties")
    if any(r["metrics"] != ranks[0]["metrics"] for r in ranks):
        failures.append("the ranks disagree on the metrics")
    print(
        "\n".join(failures)
        or f"OK: peak RSS within the bound; exact top-{args.k} in {eval_s:.1f} s wall ({eval_cpu_s:.1f} s of CPU per "
        f"rank; load average {summary['load_average_1min']:.1f} on {os.cpu_count()} cores)"
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
