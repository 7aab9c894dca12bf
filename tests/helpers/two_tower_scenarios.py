"""Per-rank scenarios of the two-tower model (run through ``tests.helpers.dist.run_ranks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_rec import RecShardStrategy
from lightning_rec.data.movielens_retrieval import MovieLensRetrievalDataModule
from lightning_rec.models.two_tower import in_batch_softmax_loss
from tests.helpers.zoo import seeded_module
from tests.helpers.zoo_two_tower import CASE

# Real sharding on 2 ranks, column-wise included (evaluation only: no optimizer state to differ).
EVAL_PLAN = {
    "t_user_id": {"sharding_types": ["column_wise"]},
    "t_history": {"sharding_types": ["column_wise"]},
    "t_item_id": {"sharding_types": ["table_wise"]},
    "t_genres": {"sharding_types": ["data_parallel"]},
}


def softmax_inputs(total: int = 7, dim: int = 4) -> dict[str, torch.Tensor]:
    """A fixed global batch for the gathered softmax: queries, candidates, item ids (with repeats), log q."""
    g = torch.Generator().manual_seed(3)
    return {
        "q": torch.nn.functional.normalize(torch.randn(total, dim, generator=g), dim=1),
        "c": torch.nn.functional.normalize(torch.randn(total, dim, generator=g), dim=1),
        "ids": torch.tensor([5, 2, 5, 9, 2, 1, 7])[:total],
        "log_q": -torch.rand(total, generator=g) * 3,
    }


def rank_rows(total: int, rank: int, world_size: int) -> slice:
    """Rank 0 takes one row more than rank 1 (batches of unequal sizes)."""
    if world_size == 1:
        return slice(0, total)
    first = total // 2 + 1
    return slice(0, first) if rank == 0 else slice(first, total)


def evaluate(rank: int, world_size: int, out_dir: Path, data_dir: str) -> dict[str, Any]:
    """Validate and test the zoo case's seeded two-tower model with real sharding; report the metrics, every test
    query's rank and embedding (predict), save a checkpoint; then the gathered softmax on batches of unequal sizes."""
    dm = MovieLensRetrievalDataModule(data_dir, download=False, eval_batch_size=300)
    module = seeded_module(CASE)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=RecShardStrategy(constraints=EVAL_PLAN),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    result: dict[str, Any] = {}
    trainer.validate(module, dm)
    result.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    trainer.test(module, dm)
    result.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    predictions = trainer.predict(module, dm)
    result["target"] = torch.cat([p["target"] for p in predictions]).tolist()
    result["rank"] = torch.cat([p["rank"] for p in predictions]).tolist()
    result["query"] = torch.cat([p["query"] for p in predictions]).tolist()
    trainer.save_checkpoint(out_dir / "ckpt")

    x = softmax_inputs()
    mine = rank_rows(x["q"].shape[0], rank, world_size)
    q = x["q"][mine].clone().requires_grad_(True)
    c = x["c"][mine].clone().requires_grad_(True)
    loss = in_batch_softmax_loss(q, c, x["ids"][mine], temperature=0.5, log_q=x["log_q"][mine])
    loss.backward()
    result["softmax"] = {"loss": float(loss), "q_grad": q.grad.tolist(), "c_grad": c.grad.tolist()}
    result["world_size"] = dist.get_world_size()
    result["plan"] = {
        table: str(p.sharding_type) for m in trainer.strategy.sharding_plan.plan.values() for table, p in m.items()
    }
    return result
