"""Peak memory of saving and loading a sharded checkpoint, against the size of each rank's own shards.

Each rank holds its table shards plus their Adagrad accumulators (the "local state"); a strategy that gathered
full tables would need the whole model on one rank. A sampler thread reads this process's RSS every 2 ms
while ``save_checkpoint`` / ``load_checkpoint`` run; the figure is the peak RSS above the level just before
the call.

    .venv/bin/python benchmarks/checkpoint_memory.py --devices 2 --rows 1000000 --dim 64 --tables 4

Prints one JSON line per rank, then (rank 0) a summary line with the ratios used in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import lightning_rec
from lightning_rec import Batch, RecShardStrategy
from lightning_rec.testing import QUIET_TRAINER

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """Peak RSS above the starting level while the ``with`` block runs."""

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def delta(self) -> int:
        return self.peak - self.start


class Model(lightning_rec.RecLightningModule):
    def __init__(self, tables: int, rows: int, dim: int) -> None:
        super().__init__()
        self.features = [f"f{i}" for i in range(tables)]
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f])
                for i, f in enumerate(self.features)
            ],
            device=torch.device("meta"),
        )
        self.head = torch.nn.Linear(tables * dim, 1)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        pooled = self.ebc(batch.sparse_features).to_dict()
        logits = self.head(torch.cat([pooled[f] for f in self.features], dim=1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, batch.labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(self.parameters(), lr=0.01)


class MeasuredStrategy(RecShardStrategy):
    """recshard, recording the peak RSS of each checkpoint save and load."""

    measured: dict[str, int] = {}

    def _measure(self, name: str, fn: Callable[[], Any]) -> Any:
        with PeakRSS() as peak:
            out = fn()
        self.measured[name] = peak.delta
        return out

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self._measure(
            "save", lambda: super(MeasuredStrategy, self).save_checkpoint(checkpoint, filepath, storage_options)
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Any = None) -> dict[str, Any]:
        return self._measure(
            "load", lambda: super(MeasuredStrategy, self).load_checkpoint(checkpoint_path, weights_only)
        )


def batches(tables: int, rows: int, n: int, batch_size: int = 256) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(tables)],
            values=torch.randint(0, rows, (tables * batch_size,), generator=g),
            lengths=torch.ones(tables * batch_size, dtype=torch.int32),
        )
        out.append(
            Batch(
                dense_features=torch.zeros(batch_size, 0),
                sparse_features=kjt,
                labels=torch.rand(batch_size, generator=g).round(),
            )
        )
    return DataLoader(out, batch_size=None)


def local_state_bytes(model: torch.nn.Module, trainer: L.Trainer) -> int:
    """Bytes of the table shards and fused optimizer state this rank holds."""
    fused = trainer.strategy.sharded_model.fused_optimizer.state_dict()["state"]
    values = [*model.state_dict().values(), *(v for entries in fused.values() for v in entries.values())]
    return sum(_local_shard_bytes(value) for value in values)


def _local_shard_bytes(value: Any) -> int:
    """Bytes of this rank's shards of a sharded table or its optimizer state (a ``ShardedTensor``), else 0."""
    local_shards = getattr(value, "local_shards", None)  # torch keeps ShardedTensor's type in a private module
    return sum(s.tensor.numel() * s.tensor.element_size() for s in local_shards()) if local_shards else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    args = parser.parse_args()
    root = Path(args.dir or os.environ.get("CKPT_BENCH_DIR") or tempfile.mkdtemp(prefix="ckpt_bench_"))
    os.environ["CKPT_BENCH_DIR"] = str(root)  # the launcher re-runs this script per rank: share the directory
    constraints = {f"t{i}": {"sharding_types": ["table_wise"]} for i in range(args.tables)}
    common = dict(
        accelerator="cpu",
        devices=args.devices,
        **QUIET_TRAINER,
    )

    model = Model(args.tables, args.rows, args.dim)
    trainer = L.Trainer(strategy=MeasuredStrategy(constraints=constraints, report_plan=False), max_steps=2, **common)
    trainer.fit(model, batches(args.tables, args.rows, 2))
    local = local_state_bytes(model, trainer)
    path = root / "bench.ckpt"
    trainer.save_checkpoint(path)
    saved = dict(MeasuredStrategy.measured)

    model2 = Model(args.tables, args.rows, args.dim)
    trainer2 = L.Trainer(strategy=MeasuredStrategy(constraints=constraints, report_plan=False), max_steps=2, **common)
    trainer2.fit(model2, batches(args.tables, args.rows, 2), ckpt_path=path)  # restores, then has nothing to train
    full = args.tables * args.rows * args.dim * 4 * 2  # every table + its Adagrad accumulator, fp32
    result = {
        "rank": trainer.global_rank,
        "local_state_mb": local / 2**20,
        "full_model_state_mb": full / 2**20,
        "save_peak_mb": saved["save"] / 2**20,
        "load_peak_mb": MeasuredStrategy.measured["load"] / 2**20,
    }
    print(json.dumps(result), flush=True)
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, result)
    if trainer.global_rank == 0:
        worst_save = max(r["save_peak_mb"] for r in everything)
        worst_load = max(r["load_peak_mb"] for r in everything)
        biggest_local = max(r["local_state_mb"] for r in everything)
        print(
            json.dumps(
                {
                    "summary": True,
                    "devices": args.devices,
                    "save_peak_over_local_state": round(worst_save / biggest_local, 3),
                    "load_peak_over_local_state": round(worst_load / biggest_local, 3),
                    "save_peak_over_full_model": round(worst_save / result["full_model_state_mb"], 3),
                    "load_peak_over_full_model": round(worst_load / result["full_model_state_mb"], 3),
                    "largest_tensor_mb": args.rows * args.dim * 4 / 2**20,
                }
            ),
            flush=True,
        )
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
