"""Per-rank scenarios for metrics (run through tests.helpers.dist.run_ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist

from lightning_rec.metrics import ctr_metrics


def fixed_data(rows: int, seed: int = 0):
    """Probabilities that carry some signal and 0/1 targets, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    target = (torch.rand(rows, generator=g) < 0.4).long()
    preds = torch.sigmoid(torch.randn(rows, generator=g) + 1.2 * (target - 0.5))
    return preds, target


def ctr(rank: int, world_size: int, out_dir: Path, rows: int = 1001, seed: int = 0) -> Dict[str, Any]:
    """Each rank updates on an uneven share of the same rows; compute() syncs over the process group."""
    dist.init_process_group("gloo")
    preds, target = fixed_data(rows, seed)
    bounds = [0, rows // 3, rows] if world_size == 2 else [round(rows * r / world_size) for r in range(world_size + 1)]
    mine = slice(bounds[rank], bounds[rank + 1])
    metrics = ctr_metrics()
    for chunk in torch.arange(mine.start, mine.stop).split(97):  # several updates per rank
        metrics.update(preds[chunk], target[chunk])
    return {k: float(v) for k, v in metrics.compute().items()}
