"""A model written the way TorchRec's tutorial and users write it, not around lightning_rec: tables built on CPU
with rows of its own, the pooled output read with ``kt.values()``, dict batches; plus the plain-PyTorch reference
it must match.

The tables are declared user, genre, item: a plan that groups them by sharding type (a sharded
``EmbeddingBagCollection`` does) moves ``genre``, so ``kt.values()`` changes column layout unless the strategy
restores the unsharded order.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import lightning_rec

TABLES = [("t_user", "user", 60), ("t_genre", "genre", 20), ("t_item", "item", 90)]
DIM = 8
# A sharded EBC groups its output by sharding type, in the order the types first appear: this plan returns
# user, item, genre (on 1 rank and on 2) where the unsharded module returns user, genre, item. The column-wise
# tables are split in two column blocks of 4 (`min_partition`; TorchRec's default block of 128 would keep an 8-wide
# table in one shard at column 0): one per rank on 2 ranks, both on rank 0 on 1. The model's `torch.optim.Adagrad`
# becomes FBGEMM's exact (per-value) Adagrad, exact under column splits (row-wise Adagrad would not be).
REORDERING_PLAN = {
    "t_user": {"sharding_types": ["column_wise"], "min_partition": 4},
    "t_genre": {"sharding_types": ["data_parallel"]},
    "t_item": {"sharding_types": ["column_wise"], "min_partition": 4},
}
# The (row, column) offsets of the shards REORDERING_PLAN makes of each table (on 1 rank and on 2).
REORDERING_PLAN_SHARDS = {"t_user": [[0, 0], [0, 4]], "t_genre": [], "t_item": [[0, 0], [0, 4]]}
# Every table whole on one rank: the declared order.
TABLE_WISE_PLAN = {t: {"sharding_types": ["table_wise"]} for t, _, _ in TABLES}


class ValuesModel(lightning_rec.RecLightningModule):
    """``kt.values()`` of a 3-table EBC built on CPU (its rows drawn from ``seed``) + a small MLP; dict batches
    ``{"sparse": KJT, "dense": [B, 2], "label": [B]}`` (``fmt="tuple"``: ``(KJT, dense, label)``)."""

    def __init__(self, seed: int = 7, lr: float = 0.05, fmt: str = "dict", batchnorm: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=n, feature_names=[f]) for t, f, n in TABLES
            ],
            device=torch.device("cpu"),
        )
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # "pretrained" rows: what the sharded tables must start from
            for p in self.ebc.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        norm = [nn.BatchNorm1d(8)] if batchnorm else []  # batch statistics: whole-batch only with sync_batchnorm
        self.over = nn.Sequential(nn.Linear(len(TABLES) * DIM + 2, 8), *norm, nn.ReLU(), nn.Linear(8, 1))
        with torch.no_grad():
            for p in self.over.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.losses: list[float] = []

    def forward(self, batch: Any) -> torch.Tensor:
        sparse, dense = (batch["sparse"], batch["dense"]) if self.hparams.fmt == "dict" else (batch[0], batch[1])
        kt = self.ebc(sparse)
        return self.over(torch.cat([kt.values(), dense], dim=1)).squeeze(1)

    def forward_dict(self, batch: dict[str, Any]) -> torch.Tensor:
        """``forward`` on a dict batch, whatever ``fmt`` the model was built for (the reference uses it)."""
        return self(batch if self.hparams.fmt == "dict" else (batch["sparse"], batch["dense"], batch["label"]))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        label = batch["label"] if self.hparams.fmt == "dict" else batch[2]
        loss = F.binary_cross_entropy_with_logits(self(batch), label)
        self.losses.append(loss.item())
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(self.parameters(), lr=self.hparams.lr)


def samples(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` samples: one user, 0-3 genres, one item, two dense values and a label that depends on them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        user, item = int(torch.randint(0, 60, (1,), generator=g)), int(torch.randint(0, 90, (1,), generator=g))
        genres = torch.randint(0, 20, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
        out.append(
            {
                "user": [user],
                "genre": genres,
                "item": [item],
                "dense": torch.rand(2, generator=g).tolist(),
                "label": float((user % 3 == 0) ^ (item % 2 == 0)),
            }
        )
    return out


def to_batch(rows: Sequence[dict[str, Any]], fmt: str = "dict") -> Any:
    """A batch of ``rows`` (a KJT with features user, genre, item): a dict, or with ``fmt="tuple"`` a tuple."""
    keys = [f for _, f, _ in TABLES]
    values = [v for k in keys for r in rows for v in r[k]]
    lengths = [len(r[k]) for k in keys for r in rows]
    batch = {
        "sparse": KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.tensor(values, dtype=torch.long), lengths=torch.tensor(lengths, dtype=torch.int32)
        ),
        "dense": torch.tensor([r["dense"] for r in rows]),
        "label": torch.tensor([r["label"] for r in rows]),
    }
    return batch if fmt == "dict" else (batch["sparse"], batch["dense"], batch["label"])


def global_batches(steps: int, batch_size: int, seed: int = 11) -> list[list[dict[str, Any]]]:
    """``steps`` global batches of ``batch_size`` samples (as sample lists)."""
    rows = samples(steps * batch_size, seed)
    return [rows[i * batch_size : (i + 1) * batch_size] for i in range(steps)]


def rank_share(rows: Sequence[dict[str, Any]], rank: int, world_size: int) -> list[dict[str, Any]]:
    """This rank's contiguous share of a global batch."""
    per = len(rows) // world_size
    return list(rows[rank * per : (rank + 1) * per])


def reference(
    model: nn.Module, batches: Sequence[Sequence[dict[str, Any]]], heldout: Sequence[dict[str, Any]], lr: float
):
    """Plain PyTorch, unsharded, on whole batches: per-step losses and the trained model's logits (in eval mode) on
    ``heldout``."""
    model = copy.deepcopy(model)
    opt = torch.optim.Adagrad(model.parameters(), lr=lr)
    losses = []
    for rows in batches:
        batch = to_batch(rows)
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model.forward_dict(batch), batch["label"])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()  # as trainer.predict does
    with torch.no_grad():
        logits = model.forward_dict(to_batch(heldout)).tolist()
    return losses, logits
