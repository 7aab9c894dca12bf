"""``python -m lightning_rec.bench``: what recshard costs over hand-written TorchRec, and what it saves over a plain
Lightning model, measured A/B alternated in one run.

Variants (same model, data, plan, kernels and optimizer):

* ``raw``: a hand-written TorchRec loop: ``DistributedModelParallel`` + ``CombinedOptimizer``, fused tables;
* ``raw_pipeline``: TorchRec's ``TrainPipelineSparseDist`` driven by hand;
* ``recshard``: ``L.Trainer(strategy=RecShardStrategy(...))``;
* ``recshard_pipelined``: the same with ``RecShardStrategy(pipeline=True)``;
* ``lightning_ddp``: what a Lightning user writes without this package: ``nn.EmbeddingBag`` tables and the same
  optimizer under Lightning's default strategy (DDP with several processes).

Sizes: ``tiny`` (loop overhead), ``realistic`` (a step of tens of ms: 8 tables of 200k x 64, batch 4096) and
``realistic_2proc`` (the same on 2 gloo processes). Every (variant, size, repeat) runs in fresh processes, so
peak RSS is the variant's own; the order of variants rotates between repeats. The run first checks that
``raw`` and ``recshard`` trained identically (per-step losses, plan, compute kernels), then prints a table
and, last, one JSON line with the ratios (medians over repeats)::

    python -m lightning_rec.bench --quick          # < 5 minutes on 2 CPU cores
    python -m lightning_rec.bench --repeats 5 --sizes realistic
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Optional

VARIANTS = ("raw", "raw_pipeline", "recshard", "recshard_pipelined", "lightning_ddp")
_RESULT = "BENCH_RESULT "


@dataclass
class Size:
    """One benchmark size.

    Args:
        name: label in the report.
        tables: number of tables (one feature each).
        rows: rows per table.
        dim: embedding dimension.
        batch_size: samples per step and process.
        pooling: ids per sample and feature.
        world_size: processes (gloo on CPU, nccl on CUDA).
        steps: timed steps; ``warmup`` untimed steps run first.
        sharding: the sharding type of every table (``row_wise`` needs CUDA).
    """

    name: str
    tables: int
    rows: int
    dim: int
    batch_size: int
    pooling: int = 4
    world_size: int = 1
    steps: int = 20
    warmup: int = 5
    sharding: str = "table_wise"


SIZES = {
    "tiny": Size("tiny", tables=4, rows=1000, dim=16, batch_size=64, pooling=2, steps=200, warmup=20),
    "realistic": Size("realistic", tables=8, rows=200_000, dim=64, batch_size=4096),
    "realistic_2proc": Size("realistic_2proc", tables=8, rows=200_000, dim=64, batch_size=4096, world_size=2),
}


# ---------------------------------------------------------------------------------------------------------
# What every variant trains
# ---------------------------------------------------------------------------------------------------------


def _model_parts(size: Size, plain_tables: bool):
    import torch
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    features = [f"f{i}" for i in range(size.tables)]
    if plain_tables:
        tables = nn.ModuleDict({f: nn.EmbeddingBag(size.rows, size.dim, mode="sum", include_last_offset=True) for f in features})
    else:
        tables = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=size.dim, num_embeddings=size.rows, feature_names=[f])
                    for f in features],
            device=torch.device("meta"),
        )
    mlp = nn.Sequential(nn.Linear(size.tables * size.dim + 4, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1))
    return features, tables, mlp


class _BenchModel:
    """Factory of the benchmark model: forward(batch) -> (loss, (loss, logits)), the form TorchRec's pipeline expects."""

    @staticmethod
    def build(size: Size, plain_tables: bool = False):
        import torch
        import torch.nn.functional as F
        from torch import nn

        features, tables, mlp = _model_parts(size, plain_tables)

        class BenchModel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.tables, self.mlp, self.features = tables, mlp, features

            def pooled(self, kjt):
                if isinstance(self.tables, nn.ModuleDict):
                    jts = kjt.to_dict()
                    return [self.tables[f](jts[f].values(), jts[f].offsets()) for f in self.features]
                out = self.tables(kjt).to_dict()
                return [out[f] for f in self.features]

            def forward(self, batch):
                logits = self.mlp(torch.cat([*self.pooled(batch.sparse_features), batch.dense_features], dim=1)).squeeze(1)
                loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
                return loss, (loss.detach(), logits.detach())  # TorchRec's pipeline returns the second part

        return BenchModel()


def _batches(size: Size, rank: int, n: int):
    import torch
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(n):
        count = size.tables * size.batch_size * size.pooling
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(size.tables)],
            values=torch.randint(0, size.rows, (count,), generator=g),
            lengths=torch.full((size.tables * size.batch_size,), size.pooling, dtype=torch.int32),
        )
        out.append(Batch(dense_features=torch.rand(size.batch_size, 4, generator=g), sparse_features=kjt,
                         labels=torch.randint(0, 2, (size.batch_size,), generator=g).float()))
    return out


def _pattern_init(module) -> None:
    """Same starting weights in every variant, whatever the plan: a value per (name, global index)."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    def pattern(name, shape, offsets):
        phase = sum(map(ord, name.replace("tables.", "").replace(".weight", ""))) % 97
        idx = [torch.arange(o, o + s, dtype=torch.float64) for o, s in zip(offsets, shape)]
        grid = idx[0] * 0.37 if len(idx) == 1 else idx[0][:, None] * 0.37 + idx[1][None, :] * 0.11
        return (0.05 * torch.sin(grid + phase)).float()

    with torch.no_grad():
        for name, t in module.state_dict().items():
            key = name.replace("embedding_bags.t_", "").replace("tables.", "")
            if isinstance(t, ShardedTensor):
                for shard in t.local_shards():
                    shard.tensor.copy_(pattern(key, shard.tensor.shape, list(shard.metadata.shard_offsets)))
            elif t.is_floating_point():
                t.copy_(pattern(key, t.shape, [0] * t.dim()).to(t.device))


# ---------------------------------------------------------------------------------------------------------
# One run of one variant (in a worker process)
# ---------------------------------------------------------------------------------------------------------


def _constraints(size: Size) -> Dict[str, Dict[str, Any]]:
    return {f"t_f{i}": {"sharding_types": [size.sharding], "compute_kernels": ["fused"]} for i in range(size.tables)}


def _plan_rows(plan) -> Dict[str, Any]:
    from lightning_rec.sharding import plan_rows

    return {r.table: [r.sharding_type, r.compute_kernel, r.ranks] for r in plan_rows(plan)}


def _run_raw(size: Size, lr: float, device, pipelined: bool) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model = _BenchModel.build(size)
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr})
    constraints = {t: ParameterConstraints(**c) for t, c in _constraints(size).items()}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=size.world_size, compute_device=device.type, local_world_size=size.world_size),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])
    _pattern_init(dmp.module)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.SGD(ps, lr=lr))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    loader = torch.utils.data.DataLoader(_batches(size, dist.get_rank(), size.warmup + size.steps), batch_size=None)
    stamps: List[float] = []
    losses: List[float] = []
    if pipelined:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        pipeline = TrainPipelineSparseDist(dmp, optimizer, device, execute_all_batches=True)
        it = iter(loader)
        for _ in range(size.warmup + size.steps):
            loss, _ = pipeline.progress(it)  # runs forward, backward and the optimizer step
            losses.append(float(loss))
            stamps.append(time.perf_counter())
    else:
        for batch in loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            loss, _ = dmp(batch)
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
            stamps.append(time.perf_counter())
    return {"stamps": stamps, "losses": losses, "plan": _plan_rows(dmp.plan)}


def _lightning_module(size: Size, lr: float, plain_tables: bool):
    import lightning as L
    import torch

    import lightning_rec

    base = lightning_rec.RecLightningModule if not plain_tables else L.LightningModule

    class Module(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.model = _BenchModel.build(size, plain_tables)
            self.losses: List[float] = []

        def forward(self, batch):
            return self.model(batch)

        def training_step(self, batch, batch_idx):
            loss, _ = self(batch)
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    return Module()


def _run_lightning(size: Size, lr: float, device, plain_tables: bool, pipeline: bool = False) -> Dict[str, Any]:
    import lightning as L
    import torch

    from lightning_rec import RecShardStrategy

    stamps: List[float] = []

    class Clock(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            if not plain_tables:
                _pattern_init(pl_module.model)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            stamps.append(time.perf_counter())

    module = _lightning_module(size, lr, plain_tables)
    if plain_tables:
        _pattern_init(module.model)
        strategy: Any = "ddp" if size.world_size > 1 else "auto"
    else:
        strategy = RecShardStrategy(constraints=_constraints(size), plan_report=False, pipeline=pipeline)
    trainer = L.Trainer(
        accelerator=device.type if device.type == "cpu" else "gpu", devices=size.world_size, strategy=strategy,
        max_steps=size.warmup + size.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, callbacks=[Clock()],
    )
    loader = torch.utils.data.DataLoader(_batches(size, int(os.environ["RANK"]), size.warmup + size.steps), batch_size=None)
    trainer.fit(module, loader)
    plan = None if plain_tables else _plan_rows(trainer.strategy.sharding_plan)
    return {"stamps": stamps, "losses": module.losses, "plan": plan}


def _worker(variant: str, size: Size, lr: float) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}") if torch.cuda.is_available() else torch.device("cpu")
    if variant in ("raw", "raw_pipeline"):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        out = _run_raw(size, lr, device, pipelined=variant == "raw_pipeline")
    else:
        out = _run_lightning(size, lr, device, plain_tables=variant == "lightning_ddp", pipeline=variant == "recshard_pipelined")
    steps = [b - a for a, b in zip(out["stamps"][size.warmup - 1:], out["stamps"][size.warmup:])]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = {
        "variant": variant, "size": size.name, "rank": int(os.environ["RANK"]), "ms_per_step": 1000 * statistics.median(steps),
        "peak_rss_bytes": rss, "losses": out["losses"], "plan": out["plan"], "device": device.type,
    }
    print(_RESULT + json.dumps(record), flush=True)
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------------------------------------------
# The orchestrator
# ---------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(variant: str, size: Size, lr: float = 0.01, timeout: float = 600) -> List[Dict[str, Any]]:
    """Run ``variant`` at ``size`` on ``size.world_size`` fresh processes; every rank's record."""
    port, procs = _free_port(), []
    for rank in range(size.world_size):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(size.world_size),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size.world_size), "NODE_RANK": "0",
               "PYTHONWARNINGS": "ignore"}
        cmd = [sys.executable, "-m", "lightning_rec.bench", "--worker", variant, "--size-json", json.dumps(asdict(size)), "--lr", str(lr)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    records, logs = [], []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        logs.append(out)
        records += [json.loads(line[len(_RESULT):]) for line in out.splitlines() if line.startswith(_RESULT)]
    if any(p.returncode for p in procs) or len(records) != size.world_size:
        raise RuntimeError(f"bench variant {variant} at {size.name} failed:\n" + "\n".join(log[-3000:] for log in logs))
    return sorted(records, key=lambda r: r["rank"])


def _summary(records: List[Dict[str, Any]], size: Size) -> Dict[str, float]:
    ms = max(r["ms_per_step"] for r in records)  # ranks step together; the slowest sets the pace
    return {"ms_per_step": ms, "samples_per_s": 1000 * size.batch_size * size.world_size / ms,
            "peak_rss_mb": max(r["peak_rss_bytes"] for r in records) / 2**20}


def check_identical(a: List[Dict[str, Any]], c: List[Dict[str, Any]], atol: float = 1e-5) -> None:
    """Raise unless ``raw`` and ``recshard`` trained identically: same plan and kernels, same per-step losses."""
    for ra, rc in zip(a, c):
        if ra["plan"] != rc["plan"]:
            raise AssertionError(f"plans differ: raw {ra['plan']} vs recshard {rc['plan']}")
        diffs = [abs(x - y) for x, y in zip(ra["losses"], rc["losses"])]
        if len(ra["losses"]) != len(rc["losses"]) or max(diffs) > atol:
            raise AssertionError(f"per-step losses differ (max {max(diffs):.2e}): raw {ra['losses'][:5]} vs recshard {rc['losses'][:5]}")


def _ratio(results, size: str, num: str, den: str, key: str = "samples_per_s") -> Optional[float]:
    try:
        return round(statistics.median(results[size][num][key]) / statistics.median(results[size][den][key]), 4)
    except (KeyError, statistics.StatisticsError, ZeroDivisionError):
        return None


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run the benchmark (see the module docstring); returns the final JSON record."""
    parser = argparse.ArgumentParser(prog="python -m lightning_rec.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (< 5 minutes on 2 cores)")
    parser.add_argument("--repeats", type=int, default=None, help="alternated repeats per variant (default 3, quick 2)")
    parser.add_argument("--sizes", default="tiny,realistic,realistic_2proc")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--sharding", default="table_wise", help="every table's sharding type (row_wise: CUDA only)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size-json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, Size(**json.loads(args.size_json)), args.lr)
        return {}
    repeats = args.repeats or (2 if args.quick else 3)
    variants = [v for v in args.variants.split(",") if v]
    results: Dict[str, Dict[str, Dict[str, List[float]]]] = {}
    for size_name in args.sizes.split(","):
        size = replace(SIZES[size_name], sharding=args.sharding)
        if args.quick:
            size = replace(size, steps=max(10, size.steps // 4), warmup=max(3, size.warmup // 2))
        per_variant: Dict[str, Dict[str, List[float]]] = {}
        first: Dict[str, List[Dict[str, Any]]] = {}
        for rep in range(repeats):
            order = variants[rep % len(variants):] + variants[: rep % len(variants)]
            for variant in order:
                records = run_variant(variant, size, args.lr)
                first.setdefault(variant, records)
                for key, value in _summary(records, size).items():
                    per_variant.setdefault(variant, {}).setdefault(key, []).append(value)
                print(f"{size.name:16s} rep {rep} {variant:14s} {records[0]['ms_per_step']:9.2f} ms/step", flush=True)
        if "raw" in first and "recshard" in first:
            check_identical(first["raw"], first["recshard"])
            print(f"{size.name}: raw and recshard trained identically (losses, plan, kernels)", flush=True)
        if "raw" in first and "recshard_pipelined" in first:
            check_identical(first["raw"], first["recshard_pipelined"])
            print(f"{size.name}: raw and recshard_pipelined trained identically (losses, plan, kernels)", flush=True)
        results[size.name] = per_variant
    print(f"\n{'size':16s} {'variant':14s} {'ms/step':>9s} {'samples/s':>11s} {'peak RSS MB':>12s}")
    for size_name, per_variant in results.items():
        for variant, values in per_variant.items():
            print(f"{size_name:16s} {variant:14s} {statistics.median(values['ms_per_step']):9.2f} "
                  f"{statistics.median(values['samples_per_s']):11.0f} {statistics.median(values['peak_rss_mb']):12.0f}")
    tiny = results.get("tiny", {})
    overhead = None
    if "recshard" in tiny and "raw" in tiny:
        overhead = round(statistics.median(tiny["recshard"]["ms_per_step"]) - statistics.median(tiny["raw"]["ms_per_step"]), 4)
    final = {
        "recshard_vs_raw": _ratio(results, "realistic", "recshard", "raw"),
        "pipelined_vs_raw_pipeline": _ratio(results, "realistic", "recshard_pipelined", "raw_pipeline"),
        "pipelined_vs_raw_pipeline_2proc": _ratio(results, "realistic_2proc", "recshard_pipelined", "raw_pipeline"),
        "overhead_ms": overhead,
        "recshard_vs_raw_2proc": _ratio(results, "realistic_2proc", "recshard", "raw"),
        "recshard_vs_lightning_ddp": _ratio(results, "realistic", "recshard", "lightning_ddp"),
        "rss_recshard_vs_raw": _ratio(results, "realistic", "recshard", "raw", "peak_rss_mb"),
        "rss_recshard_vs_lightning_ddp": _ratio(results, "realistic", "recshard", "lightning_ddp", "peak_rss_mb"),
        "raw_pipeline_vs_raw": _ratio(results, "realistic", "raw_pipeline", "raw"),
        "repeats": repeats,
    }
    print(json.dumps(final), flush=True)
    return final


if __name__ == "__main__":
    main()
