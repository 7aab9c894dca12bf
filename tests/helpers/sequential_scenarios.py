"""Per-rank scenarios of the sequential model (run through tests.helpers.dist.run_ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torchrec import EmbeddingCollection

from lightning_rec import RecShardStrategy
from lightning_rec.config import SparseFeature
from lightning_rec.data.movielens_sequential import MovieLensSequenceDataModule
from lightning_rec.models.sequential import SequentialRecModule
from tests.helpers.data import MOVIELENS_DIR


def seeded_model(dm: MovieLensSequenceDataModule, seed: int = 0, train_steps: int = 0) -> SequentialRecModule:
    """A small SASRec module whose every weight is a function of ``seed`` and the data: the item table on CPU (the
    strategy keeps its rows), then ``train_steps`` plain-PyTorch Adam steps on the training split (unsharded,
    deterministic, identical on every rank), so that its rankings have hits to compare."""
    torch.manual_seed(seed)
    model = SequentialRecModule(
        [SparseFeature("item", dm.num_items)],
        embedding_dim=16,
        max_len=dm.max_len,
        num_blocks=1,
        num_heads=2,
        dropout=0.0,
    )
    configs = model.model.item_ec.embedding_configs()
    model.model.item_ec = EmbeddingCollection(tables=configs, device=torch.device("cpu"))
    weight = model.model.item_ec.embeddings[configs[0].name].weight
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    if train_steps:
        train = dm.datasets()["train"]
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        batches = torch.arange(len(train)).split(128)
        for step in range(train_steps):
            batch = train[(step // len(batches), batches[step % len(batches)])]
            optimizer.zero_grad()
            model.loss(batch, model(batch)).backward()
            optimizer.step()
    return model


def rank_metrics(
    rank: int,
    world_size: int,
    out_dir: Path,
    max_len: int = 20,
    batch_size: int = 100,
    train_steps: int = 16,
) -> dict[str, Any]:
    """Validate and predict (test split) one seeded model with the item table column-wise: the logged HR/NDCG and
    every user's rank, on this rank."""
    dm = MovieLensSequenceDataModule(str(MOVIELENS_DIR), download=False, max_len=max_len, batch_size=batch_size)
    model = seeded_model(dm, train_steps=train_steps)
    trainer = L.Trainer(
        strategy=RecShardStrategy(constraints={"t_item": {"sharding_types": ["column_wise"], "min_partition": 8}}),
        accelerator="cpu",
        devices=world_size,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    metrics = trainer.validate(model, dm, verbose=False)[0]
    predictions = trainer.predict(model, dm)
    plan = trainer.strategy.sharding_plan.get_plan_for_module("model.item_ec")
    return {
        "metrics": metrics,
        "users": torch.cat([p["users"] for p in predictions]).tolist(),
        "ranks": torch.cat([p["rank"] for p in predictions]).tolist(),
        "sharding": {name: str(p.sharding_type) for name, p in plan.items()},
        "shard_ranks": {name: list(p.ranks or []) for name, p in plan.items()},
    }
