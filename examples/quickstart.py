"""Quickstart: a two-table model trained with sharded tables on 2 CPU processes (Lightning starts the second).

Run:  .venv/bin/python examples/quickstart.py  [--devices 2] [--max-epochs 3] [--root-dir DIR]
      torchrun --nnodes=2 --nproc-per-node=1 ... examples/quickstart.py --devices 1 --num-nodes 2
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

import lightning_rec


class Model(lightning_rec.RecLightningModule):
    def __init__(self, dim: int = 16):
        super().__init__()
        tables = [
            EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=n, feature_names=[f])
            for f, n in [("user", 100), ("item", 200)]
        ]
        # On "meta": no rank allocates a table it does not own; recshard shards them.
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.over = torch.nn.Linear(2 * dim + 1, 1)

    def forward(self, batch):
        pooled = self.ebc(batch.sparse_features).values()  # (user, item): the unsharded order under any plan
        return self.over(torch.cat([pooled, batch.dense_features], dim=1)).squeeze(1)

    def training_step(self, batch, batch_idx):
        loss = F.binary_cross_entropy_with_logits(self(batch), batch.labels)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.1)  # the tables get FBGEMM's fused Adagrad


def make_rows(n: int = 4096, seed: int = 0) -> list[dict]:
    """A learnable task: every user and item has a hidden score; the label is whether their sum is positive."""
    g = torch.Generator().manual_seed(seed)
    user_score, item_score = torch.randn(100, generator=g), torch.randn(200, generator=g)
    users, items = torch.randint(0, 100, (n,), generator=g), torch.randint(0, 200, (n,), generator=g)
    labels, noise = (user_score[users] + item_score[items] > 0).float(), torch.rand(n, generator=g)
    rows = zip(noise.tolist(), users.tolist(), items.tolist(), labels.tolist())
    return [{"dense": [x], "sparse": {"user": u, "item": i}, "label": y} for x, u, i, y in rows]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=2, help="processes per host")
    parser.add_argument("--num-nodes", type=int, default=1, help="hosts (under torchrun or SLURM)")
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--root-dir", default="lightning_logs/quickstart")
    args = parser.parse_args()
    L.seed_everything(0)
    collate = lightning_rec.RowCollator(["user", "item"])
    loader = DataLoader(make_rows(), batch_size=128, shuffle=True, collate_fn=collate)
    logger = CSVLogger(args.root_dir, name="", version="")  # metrics.csv and the plan report; checkpoints/ beside
    trainer = L.Trainer(
        strategy="recshard",
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_epochs=args.max_epochs,
        default_root_dir=args.root_dir,
        logger=logger,
    )
    trainer.fit(Model(), loader)
    if trainer.is_global_zero:
        print(f"final train_loss={float(trainer.callback_metrics['train_loss']):.4f}")
        print(f"checkpoint={trainer.checkpoint_callback.best_model_path}")
