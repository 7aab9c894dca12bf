"""``python -m lightning_rec.bench``: what recshard costs over hand-written TorchRec, and what it saves over a plain
Lightning model, measured A/B alternated in one run.

Variants (same model, data, plan, kernels and optimizer):

* ``raw``: a hand-written TorchRec loop: ``DistributedModelParallel`` + ``CombinedOptimizer``, fused tables;
* ``raw_pipeline``: TorchRec's ``TrainPipelineSparseDist`` driven by hand;
* ``recshard``: ``L.Trainer(strategy=RecShardStrategy(...))``;
* ``recshard_pipelined``: the same with ``RecShardStrategy(pipeline=True)``;
* ``lightning_ddp``: what a Lightning user writes without this package: ``nn.EmbeddingBag`` tables and the same
  optimizer under Lightning's default strategy (DDP with several processes).

Sizes: ``tiny`` (loop overhead), ``realistic`` (a step of tens of ms: 8 tables of 200k x 64, batch 4096),
``realistic_2proc`` (the same on 2 gloo processes) and ``large`` (8 tables of 1M x 64: tables dominate memory,
the size for the comparison with plain Lightning). Every (variant, size, repeat) runs in fresh processes, so
peak RSS is the variant's own; the order of variants rotates between repeats. The run first checks that
``raw``, ``recshard`` and ``recshard_pipelined`` trained identically (per-step losses, plan, compute kernels),
then prints a table and, last, one JSON line with the ratios (medians over repeats)::

    python -m lightning_rec.bench --quick                 # < 5 minutes on 2 CPU cores, sizes tiny/realistic/2proc
    python -m lightning_rec.bench --sizes tiny,realistic,realistic_2proc,large --repeats 5
    python -m lightning_rec.bench --sizes realistic --batch-sizes 512,1024,2048,4096,8192 --plot bench.png
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
from typing import Any, Dict, List, Optional, Tuple

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
    "realistic": Size("realistic", tables=8, rows=200_000, dim=64, batch_size=4096, steps=60),
    "realistic_2proc": Size("realistic_2proc", tables=8, rows=200_000, dim=64, batch_size=4096, world_size=2, steps=40),
    # Tables dominate memory (2 GB of fp32 rows): where plain nn.EmbeddingBag's dense gradients cost the most.
    "large": Size("large", tables=8, rows=1_000_000, dim=64, batch_size=4096, steps=8, warmup=3),
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

    def fill(out, name, offsets, block=8192):
        # Row blocks, so that the float64 temporaries stay a few MB and do not set the peak RSS of the run.
        phase = sum(map(ord, name.replace("tables.", "").replace(".weight", ""))) % 97
        for start in range(0, out.shape[0], block):
            rows = out[start:start + block]
            idx = [torch.arange(o, o + s, dtype=torch.float64) for o, s in zip([offsets[0] + start, *offsets[1:]], rows.shape)]
            grid = idx[0] * 0.37 if len(idx) == 1 else idx[0][:, None] * 0.37 + idx[1][None, :] * 0.11
            rows.copy_((0.05 * torch.sin(grid + phase)).float())

    with torch.no_grad():
        for name, t in module.state_dict().items():
            key = name.replace("embedding_bags.t_", "").replace("tables.", "")
            if isinstance(t, ShardedTensor):
                for shard in t.local_shards():
                    fill(shard.tensor, key, list(shard.metadata.shard_offsets))
            elif t.is_floating_point():
                fill(t, key, [0] * t.dim())


# ---------------------------------------------------------------------------------------------------------
# One run of one variant (in a worker process)
# ---------------------------------------------------------------------------------------------------------


def _stamp() -> Tuple[float, int]:
    """(time, minor page faults so far) after a step: faults per step show memory the allocator hands back to the OS
    and touches again every step, a cost that ms/step alone does not explain."""
    return time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


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
    stamps: List[Tuple[float, int]] = []
    losses: List[float] = []
    if pipelined:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        pipeline = TrainPipelineSparseDist(dmp, optimizer, device, execute_all_batches=True)
        it = iter(loader)
        for _ in range(size.warmup + size.steps):
            loss, _ = pipeline.progress(it)  # runs forward, backward and the optimizer step
            losses.append(float(loss))
            stamps.append(_stamp())
    else:
        for batch in loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            loss, _ = dmp(batch)
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
            stamps.append(_stamp())
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

    stamps: List[Tuple[float, int]] = []

    class Clock(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            if not plain_tables:
                _pattern_init(pl_module.model)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            stamps.append(_stamp())

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
    timed = out["stamps"][size.warmup - 1:]
    steps = [b[0] - a[0] for a, b in zip(timed, timed[1:])]
    faults = (timed[-1][1] - timed[0][1]) / max(1, len(timed) - 1)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = {
        "variant": variant, "size": size.name, "rank": int(os.environ["RANK"]), "ms_per_step": 1000 * statistics.median(steps),
        "page_faults_per_step": faults,
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


# glibc's default heap trimming is adaptive: whether a process hands ~10 MB back to the OS and page-faults it in
# again every step depends on the order of its allocations, so two equivalent loops can differ by several percent
# for that reason alone (see BENCHMARKS.md: page faults per step). "steady" keeps freed memory in the heap, the
# same for every variant, so that ratios measure the code; "default" leaves glibc as it is. Variables the user
# already set win.
MALLOC_SETTINGS = {
    "steady": {"MALLOC_TRIM_THRESHOLD_": str(512 << 20), "MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TOP_PAD_": str(64 << 20)},
    "default": {},
}


def run_variant(variant: str, size: Size, lr: float = 0.01, timeout: float = 600, malloc: str = "steady") -> List[Dict[str, Any]]:
    """Run ``variant`` at ``size`` on ``size.world_size`` fresh processes; every rank's record.

    Args:
        malloc: ``"steady"`` (glibc keeps freed memory: no per-step page faults, in every variant) or
            ``"default"`` (glibc as configured); see :data:`MALLOC_SETTINGS`.
    """
    port, procs = _free_port(), []
    for rank in range(size.world_size):
        # Every variant gets the thread count Lightning's launcher would pick (cores / processes): two processes
        # with a full set of threads each would fight over the cores, more in some variants than in others.
        threads = str(max(1, (os.cpu_count() or 1) // size.world_size))
        env = {**MALLOC_SETTINGS[malloc], "OMP_NUM_THREADS": threads, **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(size.world_size),
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
            "peak_rss_mb": max(r["peak_rss_bytes"] for r in records) / 2**20,
            "page_faults_per_step": max(r["page_faults_per_step"] for r in records)}


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


Results = Dict[str, Dict[str, Dict[str, List[float]]]]  # size label -> variant -> metric -> one value per repeat


def measure(size: Size, variants: List[str], repeats: int, lr: float = 0.01, malloc: str = "steady") -> Dict[str, Dict[str, List[float]]]:
    """Run every variant ``repeats`` times at ``size`` (order rotating), check that ``raw``, ``recshard`` and
    ``recshard_pipelined`` trained identically, and return variant -> metric -> values."""
    per_variant: Dict[str, Dict[str, List[float]]] = {}
    first: Dict[str, List[Dict[str, Any]]] = {}
    for rep in range(repeats):
        order = variants[rep % len(variants):] + variants[: rep % len(variants)]
        for variant in order:
            records = run_variant(variant, size, lr, malloc=malloc)
            first.setdefault(variant, records)
            for key, value in _summary(records, size).items():
                per_variant.setdefault(variant, {}).setdefault(key, []).append(value)
            print(f"{size.name:16s} b{size.batch_size:<6d} rep {rep} {variant:18s} {records[0]['ms_per_step']:9.2f} ms/step "
                  f"{records[0]['page_faults_per_step']:8.0f} page faults/step",
                  flush=True)
    for other in ("recshard", "recshard_pipelined"):
        if "raw" in first and other in first:
            check_identical(first["raw"], first[other])
            print(f"{size.name}: raw and {other} trained identically (losses, plan, kernels)", flush=True)
    return per_variant


def final_record(results: Results, repeats: int) -> Dict[str, Any]:
    """The ratios the issue asks for (medians over repeats; samples/s unless named ``rss_``).

    Against plain Lightning the comparison uses ``large`` (tables dominate memory) when it was measured,
    else ``realistic``; ``tables_dominate_size`` says which.
    """
    tiny = results.get("tiny", {})
    overhead = None
    if "recshard" in tiny and "raw" in tiny:
        overhead = round(statistics.median(tiny["recshard"]["ms_per_step"]) - statistics.median(tiny["raw"]["ms_per_step"]), 4)
    big = "large" if "lightning_ddp" in results.get("large", {}) else "realistic"
    return {
        "recshard_vs_raw": _ratio(results, "realistic", "recshard", "raw"),
        "pipelined_vs_raw_pipeline": _ratio(results, "realistic", "recshard_pipelined", "raw_pipeline"),
        "pipelined_vs_raw_pipeline_2proc": _ratio(results, "realistic_2proc", "recshard_pipelined", "raw_pipeline"),
        "overhead_ms": overhead,
        "recshard_vs_raw_2proc": _ratio(results, "realistic_2proc", "recshard", "raw"),
        "recshard_vs_lightning_ddp": _ratio(results, big, "recshard", "lightning_ddp"),
        "rss_recshard_vs_raw": _ratio(results, "realistic", "recshard", "raw", "peak_rss_mb"),
        "rss_recshard_vs_lightning_ddp": _ratio(results, big, "recshard", "lightning_ddp", "peak_rss_mb"),
        "tables_dominate_size": big,
        "raw_pipeline_vs_raw": _ratio(results, "realistic", "raw_pipeline", "raw"),
        "repeats": repeats,
    }


def plot_batch_sweep(results: Results, path: str) -> None:
    """Write a PNG of median samples/s against batch size, one line per variant, for every swept size.

    ``results`` labels are ``"<size>@<batch>"`` (see :func:`main`'s ``--batch-sizes``). Needs matplotlib.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sweeps: Dict[str, Dict[str, List[Any]]] = {}
    for label, per_variant in results.items():
        name, _, batch = label.partition("@")
        if not batch:
            continue
        for variant, values in per_variant.items():
            sweeps.setdefault(name, {}).setdefault(variant, []).append((int(batch), statistics.median(values["samples_per_s"])))
    fig = Figure(figsize=(6.5 * max(1, len(sweeps)), 4.5))
    FigureCanvasAgg(fig)
    for i, (name, per_variant) in enumerate(sorted(sweeps.items())):
        ax = fig.add_subplot(1, max(1, len(sweeps)), i + 1)
        for variant in VARIANTS:
            if variant in per_variant:
                xs, ys = zip(*sorted(per_variant[variant]))
                ax.plot(xs, ys, marker="o", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (per process)")
        ax.set_ylabel("samples/s (median over repeats)")
        ax.set_title(f"{name}: {SIZES[name].tables} tables x {SIZES[name].rows:,} x {SIZES[name].dim}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run the benchmark (see the module docstring); returns the final JSON record."""
    parser = argparse.ArgumentParser(prog="python -m lightning_rec.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (< 5 minutes on 2 cores)")
    parser.add_argument("--repeats", type=int, default=None, help="alternated repeats per variant (default 3, quick 2)")
    parser.add_argument("--sizes", default="tiny,realistic,realistic_2proc", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batch-sizes", default=None, help="comma-separated: sweep every size over these batch sizes")
    parser.add_argument("--plot", default=None, help="PNG path: samples/s against batch size (with --batch-sizes)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--malloc", choices=sorted(MALLOC_SETTINGS), default="steady",
                        help="glibc heap settings of every variant's processes (default: steady; see BENCHMARKS.md)")
    parser.add_argument("--sharding", default="table_wise", help="every table's sharding type (row_wise: CUDA only)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size-json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, Size(**json.loads(args.size_json)), args.lr)
        return {}
    if args.plot and not args.batch_sizes:
        parser.error("--plot draws a batch-size sweep: give --batch-sizes too")
    repeats = args.repeats or (2 if args.quick else 3)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS)) + sorted(set(args.sizes.split(",")) - set(SIZES))
    if unknown:
        parser.error(f"unknown variant/size {unknown}; variants are {list(VARIANTS)}, sizes {list(SIZES)}")
    results: Results = {}
    for size_name in args.sizes.split(","):
        size = replace(SIZES[size_name], sharding=args.sharding)
        if args.quick:
            size = replace(size, steps=max(10, size.steps // 4), warmup=max(3, size.warmup // 2))
        batches = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else [size.batch_size]
        for batch in batches:
            label = f"{size.name}@{batch}" if args.batch_sizes else size.name
            results[label] = measure(replace(size, batch_size=batch), variants, repeats, args.lr, args.malloc)
    print(f"\n{'size':22s} {'variant':18s} {'ms/step':>9s} {'samples/s':>11s} {'peak RSS MB':>12s} {'faults/step':>12s}")
    for label, per_variant in results.items():
        for variant, values in per_variant.items():
            print(f"{label:22s} {variant:18s} {statistics.median(values['ms_per_step']):9.2f} "
                  f"{statistics.median(values['samples_per_s']):11.0f} {statistics.median(values['peak_rss_mb']):12.0f} "
                  f"{statistics.median(values['page_faults_per_step']):12.0f}")
    if args.plot:
        plot_batch_sweep(results, args.plot)
        print(f"plot: {args.plot}")
    final = {**final_record(results, repeats), "malloc": args.malloc}
    print(json.dumps(final), flush=True)
    return final


if __name__ == "__main__":
    main()
