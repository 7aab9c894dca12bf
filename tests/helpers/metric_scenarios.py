"""Per-rank scenarios for metrics (run through tests.helpers.dist.run_ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_rec.metrics import ctr_metrics


def fixed_data(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities that carry some signal and 0/1 targets, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    target = (torch.rand(rows, generator=g) < 0.4).long()
    preds = torch.sigmoid(torch.randn(rows, generator=g) + 1.2 * (target - 0.5))
    return preds, target


def rank_slices(rows: int, world_size: int) -> list[slice]:
    """Uneven contiguous shares: rank 0 gets about a third of an even share, the rest split what is left."""
    first = rows // (3 * world_size) if world_size > 1 else rows
    rest = torch.arange(first, rows).tensor_split(world_size - 1) if world_size > 1 else []
    return [slice(0, first)] + [slice(int(r[0]), int(r[-1]) + 1) for r in rest]


def ctr(rank: int, world_size: int, out_dir: Path, rows: int = 1001, seed: int = 0) -> dict[str, Any]:
    """Each rank updates on an uneven share of the same rows; compute() syncs over the process group."""
    dist.init_process_group("gloo")
    preds, target = fixed_data(rows, seed)
    mine = rank_slices(rows, world_size)[rank]
    metrics = ctr_metrics()
    for chunk in torch.arange(mine.start, mine.stop).split(97):  # several updates per rank
        metrics.update(preds[chunk], target[chunk])
    result = {"metrics": {k: float(v) for k, v in metrics.compute().items()}, "rows": mine.stop - mine.start}
    dist.destroy_process_group()  # as a script that started its own process group ends (see lightning_rec._strategy.faults)
    return result
