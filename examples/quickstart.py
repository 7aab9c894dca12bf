"""The README quickstart: a two-table model trained with sharded tables on 2 CPU processes.

Run:  .venv/bin/python examples/quickstart.py  [--devices 2] [--max-epochs 3]
      torchrun --nnodes=2 --nproc-per-node=1 ... examples/quickstart.py --devices 1 --num-nodes 2   (README)
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

import lightning_rec
from lightning_rec import RowCollator

FEATURES = ["user", "item"]


class Model(lightning_rec.RecLightningModule):
    def __init__(self, num_users: int = 100, num_items: int = 200, dim: int = 16):
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="t_user", embedding_dim=dim, num_embeddings=num_users, feature_names=["user"]),
                EmbeddingBagConfig(name="t_item", embedding_dim=dim, num_embeddings=num_items, feature_names=["item"]),
            ],
            device=torch.device("meta"),  # no rank allocates a table it does not own
        )
        self.over = torch.nn.Linear(2 * dim + 1, 1)

    def forward(self, batch):
        # The sharded EBC returns its keys in the unsharded order (user, item) under any plan: .values() is safe.
        pooled = self.ebc(batch.sparse_features).values()
        return self.over(torch.cat([pooled, batch.dense_features], dim=1)).squeeze(1)

    def training_step(self, batch, batch_idx):
        loss = F.binary_cross_entropy_with_logits(self(batch), batch.labels)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


def make_rows(n: int = 4096, num_users: int = 100, num_items: int = 200, seed: int = 0):
    """A learnable task: every user and item has a hidden score; the label is whether their sum is positive."""
    g = torch.Generator().manual_seed(seed)
    user_score, item_score = torch.randn(num_users, generator=g), torch.randn(num_items, generator=g)
    users = torch.randint(0, num_users, (n,), generator=g)
    items = torch.randint(0, num_items, (n,), generator=g)
    labels = (user_score[users] + item_score[items] > 0).float()
    noise = torch.rand(n, generator=g)
    return [
        {
            "dense": [float(noise[i])],
            "sparse": {"user": int(users[i]), "item": int(items[i])},
            "label": float(labels[i]),
        }
        for i in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=2, help="processes per host")
    parser.add_argument("--num-nodes", type=int, default=1, help="hosts (under torchrun or SLURM)")
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--root-dir", default="lightning_logs/quickstart")
    args = parser.parse_args()
    L.seed_everything(0)
    loader = DataLoader(make_rows(), batch_size=128, shuffle=True, collate_fn=RowCollator(FEATURES))
    trainer = L.Trainer(
        strategy="recshard",
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_epochs=args.max_epochs,
        default_root_dir=args.root_dir,
        # metrics.csv and the plan report in root-dir; sharded checkpoints under root-dir/checkpoints
        logger=CSVLogger(args.root_dir, name="", version=""),
    )
    trainer.fit(Model(), loader)
    if trainer.is_global_zero:
        print(f"final train_loss={float(trainer.callback_metrics['train_loss']):.4f}")
        print(f"checkpoint={trainer.checkpoint_callback.best_model_path}")


if __name__ == "__main__":
    main()
