"""recshard's per-step overhead over hand-written TorchRec, and Lightning's own over a plain loop, paired step by
step in one process: robust to a machine whose speed drifts between (and within) runs.

The fresh-process A/B of ``python -m lightning_rec.testing.bench`` compares medians of separate runs; on a noisy machine
the spread between runs of the same variant is larger than a 0.1 ms overhead (BENCHMARKS.md, issue 14). Here every
step of a Lightning fit is followed, in the same process, by one step of its baseline on its own model and
batches, timed alone:

* ``recshard``: a recshard fit of the bench model; its baseline is the ``raw`` TorchRec step (DMP +
  ``CombinedOptimizer``, the same plan, kernels and optimizer);
* ``lightning``: a plain Lightning fit of ``lightning_sparse``'s model (``nn.EmbeddingBag(sparse=True)``); its
  baseline is the same model's step in a plain loop (``plain_sparse``).

A Lightning step is the time from one ``on_train_batch_end`` to the next, minus the baseline step run in between.
Prints one JSON line: medians per step and the differences (``overhead_ms``, ``lightning_overhead_ms``, and
recshard's beyond Lightning's).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paired_overhead.py --size tiny --steps 1000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import lightning as L
import torch

from lightning_rec import RecShardStrategy
from lightning_rec.testing.bench import SIZES, Size
from lightning_rec.testing.bench.worker import lightning_module, raw_torchrec
from lightning_rec.testing.bench.workload import (
    BenchModel,
    init_weights,
    make_batches,
    table_constraints,
    torch_optimizer,
)
from lightning_rec.testing.ports import rank_env


def _step(model: Any, optimizer: Any) -> Callable[[Any], None]:
    def step(batch: Any) -> None:
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()

    return step


class _Paired(L.Callback):
    """After each Lightning step, one baseline step (built by ``make_baseline`` once training starts), timed apart."""

    def __init__(self, make_baseline: Callable[[], Callable[[Any], None]], batches: list[Any]) -> None:
        self.make_baseline, self.batches = make_baseline, batches
        self.ends: list[float] = []
        self.baseline_ms: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.baseline = self.make_baseline()  # after the strategy started the process group

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        start = time.perf_counter()
        self.baseline(self.batches[len(self.ends) % len(self.batches)])
        end = time.perf_counter()
        self.baseline_ms.append(1000 * (end - start))
        self.ends.append(end)  # the next Lightning step starts here

    def lightning_ms(self) -> list[float]:
        """Each Lightning step: from the end of the previous baseline step to this step's end."""
        return [1000 * (b - a) - base for a, b, base in zip(self.ends, self.ends[1:], self.baseline_ms[1:])]


def measure(size: Size, steps: int, warmup: int = 20, lr: float = 0.01) -> dict[str, float]:
    """Median ms per step of recshard and raw TorchRec, and of plain Lightning and a plain loop, paired."""
    device = torch.device("cpu")
    batches = make_batches(size, 0, 64)
    out: dict[str, float] = {}
    for name, plain in (("recshard", False), ("lightning", True)):
        module = lightning_module(size, lr, plain_tables=plain, sparse=plain)
        if plain:
            init_weights(module.model)
            strategy: Any = "auto"
            baseline_model = BenchModel.build(size, plain_tables=True, sparse=True)
            init_weights(baseline_model)

            def make_baseline(model: Any = baseline_model) -> Callable[[Any], None]:
                return _step(model, torch_optimizer(size.optimizer, model.parameters(), lr))
        else:
            strategy = RecShardStrategy(constraints=table_constraints(size), report_plan=False)

            def make_baseline() -> Callable[[Any], None]:
                return _step(*raw_torchrec(size, lr, device))

        paired = _Paired(make_baseline, batches)
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=1,
            max_steps=warmup + steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            callbacks=[paired],
        )
        trainer.fit(
            module,
            torch.utils.data.DataLoader([batches[i % len(batches)] for i in range(warmup + steps)], batch_size=None),
        )
        out[f"{name}_ms"] = round(statistics.median(paired.lightning_ms()[warmup:]), 4)
        out[f"{name}_baseline_ms"] = round(statistics.median(paired.baseline_ms[warmup:]), 4)
    out["overhead_ms"] = round(out["recshard_ms"] - out["recshard_baseline_ms"], 4)
    out["lightning_overhead_ms"] = round(out["lightning_ms"] - out["lightning_baseline_ms"], 4)
    out["recshard_overhead_beyond_lightnings_ms"] = round(out["overhead_ms"] - out["lightning_overhead_ms"], 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    os.environ.update(rank_env(0, 1, int(os.environ.get("MASTER_PORT", "29573"))))
    print(
        json.dumps(
            {"size": args.size, "steps": args.steps, **measure(replace(SIZES[args.size], world_size=1), args.steps)}
        )
    )


if __name__ == "__main__":
    main()
