"""Small models, data and weight utilities shared by the tests."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import lightning_rec
from lightning_rec import Batch
from lightning_rec._compat import ShardedTensor

USERS, ITEMS, GENRES, TAGS = 60, 80, 12, 20
FEATURES = ["user", "item", "genre"]


def tables(dim: int = 8) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t_user", embedding_dim=dim, num_embeddings=USERS, feature_names=["user"]),
        EmbeddingBagConfig(name="t_item", embedding_dim=dim, num_embeddings=ITEMS, feature_names=["item"]),
        EmbeddingBagConfig(name="t_genre", embedding_dim=dim, num_embeddings=GENRES, feature_names=["genre"]),
    ]


class Towers(nn.Module):
    """A nested sparse part (an EmbeddingCollection two levels down), to test sharding at any depth."""

    def __init__(self, device: torch.device, dim: int = 8) -> None:
        super().__init__()
        self.inner = nn.ModuleDict(
            {
                "ec": EmbeddingCollection(
                    tables=[
                        EmbeddingConfig(name="t_tag", embedding_dim=dim, num_embeddings=TAGS, feature_names=["tag"])
                    ],
                    device=device,
                )
            }
        )

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        jt = self.inner["ec"](kjt)["tag"]
        return jt.to_padded_dense(desired_length=3).sum(1)


class RecModel(lightning_rec.RecLightningModule):
    """An EBC (3 tables) + optional nested EC + a small MLP; a binary classifier."""

    def __init__(
        self,
        optimizer: str = "adagrad",
        lr: float = 0.1,
        table_device: str = "meta",
        with_ec: bool = False,
        scheduler: dict[str, Any] | None = None,
        emb_optimizer: dict[str, Any] | None = None,
        manual: bool = False,
        batch_format: str = "batch",
    ) -> None:
        super().__init__()
        device = torch.device(table_device)
        self.ebc = EmbeddingBagCollection(tables=tables(), device=device)
        self.towers = Towers(device) if with_ec else None
        width = 3 * 8 + (8 if with_ec else 0) + 2
        self.mlp = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1))
        self.optimizer_name, self.lr, self.scheduler_cfg = optimizer, lr, scheduler
        self.emb_optimizer = emb_optimizer
        self.automatic_optimization = not manual
        self.batch_format = batch_format
        self.losses: list[float] = []
        self.closure_calls = 0
        self.fused_lrs: list[float] = []

    # -- the batch contract: Batch, dict or tuple holding a KJT -----------------------------------------
    def _unpack(self, batch: Any):
        if isinstance(batch, dict):
            return batch["dense"], batch["kjt"], batch["labels"]
        if isinstance(batch, (tuple, list)):
            return batch
        return batch.dense_features, batch.sparse_features, batch.labels

    def forward(self, batch: Any) -> torch.Tensor:
        dense, kjt, _ = self._unpack(batch)
        # Pooled embeddings by feature name (tests/helpers/user_models.py reads `.values()` instead).
        if self.towers is None:
            pooled = self.ebc(kjt).to_dict()
            parts = [pooled[f] for f in FEATURES]
        else:  # each sharded module gets exactly its own features
            ebc_kjt, ec_kjt = kjt.split([3, 1])
            pooled = self.ebc(ebc_kjt).to_dict()
            parts = [pooled[f] for f in FEATURES] + [self.towers(ec_kjt)]
        return self.mlp(torch.cat([*parts, dense], dim=1)).squeeze(1)

    def loss(self, batch: Any) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self(batch).float(), self._unpack(batch)[2])

    def training_step(self, batch: Any, batch_idx: int):
        self.closure_calls += 1
        rec = self.trainer.strategy._rec_optimizer
        if rec is not None:
            lrs = rec.embedding_lrs
            assert max(lrs) - min(lrs) <= 1e-6 * max(lrs), lrs  # CUDA kernels hold their rate in float32
            self.fused_lrs.append(lrs[0])
        if self.automatic_optimization:
            loss = self.loss(batch)
            self.losses.append(float(loss))
            self.log("train_loss", loss, sync_dist=True)
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        opt.step()
        self.losses.append(float(loss))

    def validation_step(self, batch: Any, batch_idx: int):
        loss = self.loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int):
        loss = self.loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int):
        return torch.sigmoid(self(batch))

    def configure_embedding_optimizer(self):
        return lightning_rec.EmbeddingOptimizer(**self.emb_optimizer) if self.emb_optimizer else None

    def configure_optimizers(self):
        if self.optimizer_name == "adagrad":
            opt = torch.optim.Adagrad(self.parameters(), lr=self.lr)
        elif self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        elif self.optimizer_name == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        elif self.optimizer_name == "sgd_momentum":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        elif self.optimizer_name == "rowwise_adagrad":
            from torchrec.optim import RowWiseAdagrad

            opt = RowWiseAdagrad(self.parameters(), lr=self.lr)
        else:
            raise ValueError(self.optimizer_name)
        if self.scheduler_cfg:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=self.scheduler_cfg["gamma"])
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        return opt


def make_batches(n_batches: int, batch_size: int, seed: int, with_ec: bool = False) -> list[Batch]:
    """Learnable synthetic data: hidden per-user and per-item scores decide the label."""
    g = torch.Generator().manual_seed(1234)
    user_score, item_score = torch.randn(USERS, generator=g), torch.randn(ITEMS, generator=g)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        users = torch.randint(0, USERS, (batch_size,), generator=g)
        items = torch.randint(0, ITEMS, (batch_size,), generator=g)
        n_genres = torch.randint(0, 4, (batch_size,), generator=g)
        genres = torch.randint(0, GENRES, (int(n_genres.sum()),), generator=g)
        keys, values, lengths = (
            ["user", "item", "genre"],
            [users, items, genres],
            [torch.ones(batch_size), torch.ones(batch_size), n_genres],
        )
        if with_ec:
            n_tags = torch.randint(1, 4, (batch_size,), generator=g)
            keys.append("tag")
            values.append(torch.randint(0, TAGS, (int(n_tags.sum()),), generator=g))
            lengths.append(n_tags)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat(values).long(), lengths=torch.cat(lengths).int()
        )
        dense = torch.rand(batch_size, 2, generator=g)
        labels = (user_score[users] + item_score[items] > 0).float()
        out.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels))
    return out


def as_format(batch: Batch, fmt: str) -> Any:
    if fmt == "dict":
        return {"dense": batch.dense_features, "kjt": batch.sparse_features, "labels": batch.labels}
    if fmt == "tuple":
        return (batch.dense_features, batch.sparse_features, batch.labels)
    return batch


def local_weights(module: nn.Module) -> dict[str, list]:
    """Every tensor this rank holds, with its global offsets: ``{name: [(offsets, tensor), ...]}``."""
    out: dict[str, list] = {}
    for name, t in module.state_dict().items():
        if isinstance(t, ShardedTensor):
            out[name] = [(list(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in t.local_shards()]
        elif isinstance(t, torch.Tensor):
            out[name] = [([0] * t.dim(), t.detach().clone())]
    return out


def plan_shards(plan: Any) -> dict[str, dict[str, Any]]:
    """What a ``ShardingPlan`` (``trainer.strategy.sharding_plan``) made of every table: ``{table: {"type": sharding
    type, "offsets": [[row, column] of each shard], "ranks": [rank of each shard]}}`` (no shards: data-parallel)."""
    out: dict[str, dict[str, Any]] = {}
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():
            shards = ps.sharding_spec.shards if ps.sharding_spec is not None else []
            out[table] = {
                "type": ps.sharding_type,
                "offsets": [list(s.shard_offsets) for s in shards],
                "ranks": [s.placement.rank() for s in shards],
            }
    return out


def sharded_forwards(module: nn.Module) -> dict[str, str]:
    """The type of the ``forward`` every sharded embedding module in ``module`` runs, by path: ``"method"`` (its own)
    or, once TorchRec's train pipeline rewrote it, ``"PipelinedForward"`` (inputs distributed ahead)."""
    from torchrec.distributed.types import ShardedModule

    return {path: type(m.forward).__name__ for path, m in module.named_modules() if isinstance(m, ShardedModule)}


def save_weights(module: nn.Module, out_dir: Path, tag: str, rank: int) -> None:
    """This rank's :func:`local_weights` into ``out_dir/<tag>.weights<rank>.pt``, for :func:`saved_weights`."""
    torch.save(local_weights(module), Path(out_dir) / f"{tag}.weights{rank}.pt")


def saved_weights(out_dir: Path, tag: str, world_size: int) -> dict[str, torch.Tensor]:
    """The global tensors every rank saved with :func:`save_weights` (see :func:`assemble`)."""
    return assemble([torch.load(Path(out_dir) / f"{tag}.weights{r}.pt") for r in range(world_size)])


def assemble(per_rank: list[dict[str, list]]) -> dict[str, torch.Tensor]:
    """Global tensors from every rank's :func:`local_weights` (replicated tensors must agree)."""
    pieces: dict[str, list] = {}
    for weights in per_rank:
        for name, shards in weights.items():
            pieces.setdefault(name, []).extend(shards)
    out = {}
    for name, shards in pieces.items():
        shape = [max(o[d] + t.shape[d] for o, t in shards) for d in range(shards[0][1].dim())]
        full = torch.full(shape, math.nan)
        for off, t in shards:
            region = full[tuple(slice(o, o + s) for o, s in zip(off, t.shape))]
            if not torch.isnan(region).all():
                assert torch.allclose(region, t, atol=1e-6), f"replicas of {name} disagree"
            region.copy_(t)
        assert not torch.isnan(full).any(), f"{name} is not fully covered by the shards"
        out[name] = full
    return out


def tiny_dlrm(dm: Any, num_dense_features: int | None = None, **kwargs: Any) -> Any:
    """The small DLRM (8-wide tables, one 8-unit dense layer, an ``[8, 1]`` over-arch) many multi-process tests train
    on ``dm``'s features; ``num_dense_features`` defaults to ``dm``'s, ``kwargs`` go to ``DLRMModule``. Seeded by the
    caller."""
    from lightning_rec.models import DLRMModule

    return DLRMModule(
        sparse_features=dm.sparse_features,
        num_dense_features=dm.num_dense_features if num_dense_features is None else num_dense_features,
        embedding_dim=8,
        dense_arch_layer_sizes=[8],
        over_arch_layer_sizes=[8, 1],
        **kwargs,
    )
