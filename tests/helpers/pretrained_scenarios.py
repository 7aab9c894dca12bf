"""Per-rank scenario: a model with tables on meta starts from rows in files (``PretrainedRows``) on a given plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import lightning_rec
from lightning_rec.callbacks import PretrainedRows
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.models import local_weights, plan_shards
from tests.helpers.user_models import samples, to_batch

# (table, feature, rows): an EBC over user/genre/item and an EC sharing nothing with it.
BAG_TABLES = [("t_user", "user", 60), ("t_genre", "genre", 20), ("t_item", "item", 90)]
SEQ_TABLE = ("t_item_seq", "item", 90)
DIM = 8


class MetaModel(lightning_rec.RecLightningModule):
    """Tables on meta (no rows of their own), pooled EBC output + the EC's values, SGD with lr 0 (nothing moves)."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=n, feature_names=[f])
                for t, f, n in BAG_TABLES
            ],
            device=torch.device("meta"),
        )
        t, f, n = SEQ_TABLE
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name=t, embedding_dim=DIM, num_embeddings=n, feature_names=[f])],
            device=torch.device("meta"),
        )
        self.over = torch.nn.Linear(len(BAG_TABLES) * DIM + 2, 1)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        items = KeyedJaggedTensor.from_jt_dict({"item": batch["sparse"]["item"]})
        seq = self.ec(items)["item"].values().sum()
        logits = self.over(torch.cat([self.ebc(batch["sparse"]).values(), batch["dense"]], 1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, batch["label"]) + 0 * seq

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _Start(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save(local_weights(pl_module), self.path)


def start_from_files(
    rank: int, world_size: int, out_dir: Path, files: dict[str, str], plans: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """For each plan: fit one step from rows in ``files``; each rank saves what it holds at train start as
    ``<plan>.start<rank>.pt``; report the sharding types used and the shards of every table (:func:`plan_shards`),
    by plan."""
    L.seed_everything(0)
    types = set()
    shards = {}
    for tag, constraints in plans.items():
        trainer = L.Trainer(
            strategy=lightning_rec.RecShardStrategy(constraints=constraints),
            accelerator="cpu",
            devices=world_size,
            max_steps=1,
            **QUIET_TRAINER,
            callbacks=[PretrainedRows(files), _Start(out_dir / f"{tag}.start{rank}.pt")],
        )
        batch = to_batch(samples(8, 3)[rank * 4 : (rank + 1) * 4])
        trainer.fit(MetaModel(), DataLoader([batch], batch_size=None))
        shards[tag] = plan_shards(trainer.strategy.sharding_plan)
        types.update(t["type"] for t in shards[tag].values())
    return {"types": sorted(types), "shards": shards}
