"""How far the planner's estimates are from what a run measures, on this machine, for the bench sizes.

For each size (``realistic``: 8 tables x 200,000 x 64, batch 4,096 per rank, on 1 process; ``realistic_2proc``: the
same on 2 gloo processes), the plan ``lightning-rec plan`` makes (``lightning_rec.plan_cluster``, tables on
``meta``) is trained with ``RecShardStrategy(plan=plan.json)``, and per rank:

* memory: the planner's estimate (HBM + DDR of the rank's shards) against the bytes the rank really holds for its
  tables (the local shards and the fused optimizer's state) and against its peak RSS growth during ``fit``;
* step time: the planner's estimate (lookups + input and output all-to-alls of the rank's tables) against the
  measured embedding step (the sharded EBC's forward and backward with the fused update, timed alone) and the whole
  Lightning training step (dense layers, loss, optimizer, Python included).

The estimates come twice: with TorchRec's default bandwidths (what ``fit`` uses) and with the ``cpu`` preset's
(``lightning_rec.Cluster(preset="cpu")``), and the script prints the bandwidths that would make the estimates match
this machine (the lookup rate from 1 process, the all-to-all rate from 2)::

    .venv/bin/python benchmarks/plan_calibration.py                 # ~2 min on 2 cores
    .venv/bin/python benchmarks/plan_calibration.py --steps 10      # quicker, noisier
    .venv/bin/python benchmarks/plan_calibration.py --optimizer adagrad   # optimizer state in the memory
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def train(
    rank: int, world_size: int, out_dir: Path, size: str, steps: int, plan: str, optimizer: str = "sgd"
) -> dict[str, Any]:
    """One rank: train the bench model with ``plan``; its table bytes, peak RSS growth, step and embedding-step times."""
    import lightning as L
    import torch

    from lightning_rec import RecShardStrategy
    from lightning_rec.testing import QUIET_TRAINER
    from lightning_rec.testing.bench.worker import lightning_module
    from lightning_rec.testing.bench.workload import SIZES, init_weights, make_batches

    s = replace(SIZES[size], steps=steps, warmup=3, optimizer=optimizer)
    batches = make_batches(s, rank, s.warmup + s.steps)
    module = lightning_module(s, 0.1, plain_tables=False)
    stamps: list[float] = []

    class Clock(L.Callback):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            init_weights(pl_module.model)

        def on_train_batch_end(self, *args: Any) -> None:
            stamps.append(time.perf_counter())

    before = _rss_mb()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=RecShardStrategy(plan=plan, report_plan=False),
        max_steps=s.warmup + s.steps,
        callbacks=[Clock()],
        **QUIET_TRAINER,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    steps_ms = [1000 * (b - a) for a, b in zip(stamps[s.warmup - 1 :], stamps[s.warmup :])]

    dmp = trainer.strategy.model
    held = 0
    for value in [*dmp.state_dict().values(), *_tensors(dmp.fused_optimizer.state_dict()["state"])]:
        shards = getattr(value, "local_shards", None)
        for t in [sh.tensor for sh in shards()] if shards else [value]:
            held += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
    dense = sum(p.numel() * p.element_size() for p in module.model.mlp.parameters())

    tables = module.model.tables  # the sharded EBC: lookups, input and output all-to-alls, fused update in backward
    emb_ms = []
    for b in batches[: s.steps]:
        torch.distributed.barrier() if world_size > 1 else None
        t0 = time.perf_counter()
        tables(b.sparse_features).values().sum().backward()
        emb_ms.append(1000 * (time.perf_counter() - t0))
    return {
        "step_ms": statistics.median(steps_ms),
        "embedding_step_ms": statistics.median(emb_ms[1:]),
        "table_bytes": held - dense,
        "rss_growth_mb": max(peak, peak_before) - before,
    }


def _tensors(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return [tree]


def estimates(size: str, world_size: int, preset: str | None, optimizer: str = "sgd") -> Any:
    """The planner's report for the bench model at ``size`` on ``world_size`` CPU ranks of one host."""
    from lightning_rec import Cluster, RecShardStrategy, plan_cluster
    from lightning_rec.testing.bench.worker import lightning_module
    from lightning_rec.testing.bench.workload import SIZES, table_constraints

    s = replace(SIZES[size], optimizer=optimizer)
    sharding = RecShardStrategy(constraints=table_constraints(s)).sharding  # what `fit` would plan with
    cluster = Cluster(1, world_size, "cpu", preset=preset, batch_size=s.batch_size)
    return plan_cluster(lightning_module(s, 0.1, plain_tables=False), sharding, cluster)


def measure(steps: int, optimizer: str = "sgd") -> dict[str, Any]:
    from lightning_rec.testing.launch import run_ranks

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size, world in (("realistic", 1), ("realistic_2proc", 2)):
            default = estimates(size, world, None, optimizer)
            calibrated = estimates(size, world, "cpu", optimizer)
            path = Path(tmp) / f"{size}.json"
            default.write_json(path)
            ranks = run_ranks(
                "benchmarks.plan_calibration:train",
                world,
                Path(tmp) / size,
                600,
                pythonpath=[str(REPO)],  # where the ranks find this file's `train` (the package is installed)
                size=size,
                steps=steps,
                plan=str(path),
                optimizer=optimizer,
            )
            rows = []
            for r, m in enumerate(ranks):
                d, c = default.ranks[r], calibrated.ranks[r]
                rows.append(
                    {
                        "rank": r,
                        "est_memory_mb": d.memory_bytes / 2**20,
                        "held_table_mb": m["table_bytes"] / 2**20,
                        "rss_growth_mb": m["rss_growth_mb"],
                        "memory_ratio": d.memory_bytes / m["table_bytes"],
                        "est_step_ms_torchrec": d.step_ms,
                        "est_lookup_ms_torchrec": d.lookup_ms,
                        "est_a2a_ms_torchrec": d.input_dist_ms + d.output_dist_ms,
                        "est_step_ms_cpu_preset": c.step_ms,
                        "embedding_step_ms": m["embedding_step_ms"],
                        "step_ms": m["step_ms"],
                        "ratio_torchrec": d.step_ms / m["embedding_step_ms"],
                        "ratio_cpu_preset": c.step_ms / m["embedding_step_ms"],
                        "ratio_cpu_preset_whole_step": c.step_ms / m["step_ms"],
                    }
                )
            out[size] = rows
    one = out["realistic"][0]
    two = out["realistic_2proc"]
    # Bandwidths that make TorchRec's default estimate match: lookups from 1 process; the all-to-alls get the rest of
    # the 2-process embedding step, after the lookups at the rate of 1 process (per rank, half the tables).
    lookup_scale = one["est_lookup_ms_torchrec"] / one["embedding_step_ms"]
    rest = [r["embedding_step_ms"] - r["est_lookup_ms_torchrec"] / lookup_scale for r in two]
    a2a_scale = statistics.mean(r["est_a2a_ms_torchrec"] for r in two) / max(1e-9, statistics.mean(rest))
    out["suggested_cpu_preset"] = {
        "ddr_bw_GBps": 51 * 1.073741824 * lookup_scale,
        "intra_host_bw_GBps": 600 * 1.073741824 * a2a_scale,
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--optimizer", choices=["sgd", "adagrad"], default="sgd", help="torch's, and FBGEMM's for the tables"
    )
    args = parser.parse_args()
    result = measure(args.steps, args.optimizer)
    for size in ("realistic", "realistic_2proc"):
        for r in result[size]:
            print(
                f"{size:16s} rank {r['rank']}: memory est {r['est_memory_mb']:.1f} MB / held {r['held_table_mb']:.1f} MB"
                f" = {r['memory_ratio']:.2f}x (RSS grew {r['rss_growth_mb']:.0f} MB); step est TorchRec "
                f"{r['est_step_ms_torchrec']:.3f} ms, cpu preset {r['est_step_ms_cpu_preset']:.2f} ms; measured "
                f"embedding step {r['embedding_step_ms']:.2f} ms, whole step {r['step_ms']:.2f} ms; ratios "
                f"{r['ratio_torchrec']:.4f}x / {r['ratio_cpu_preset']:.2f}x"
            )
    print("suggested cpu preset:", json.dumps(result["suggested_cpu_preset"]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
