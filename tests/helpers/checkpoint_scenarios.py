"""What one rank does in the checkpoint tests (exact resume, resharding). Each returns a JSON-able dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_rec._compat import ShardedTensor
from lightning_rec.checkpoint._optimizer_state import canonical_state
from tests.helpers.models import RecModel, make_batches, save_weights
from tests.helpers.scenarios import make_loader, make_trainer

PLANS = {
    "table_wise": {t: {"sharding_types": ["table_wise"]} for t in ("t_user", "t_item", "t_genre")},
    "column_wise": {
        t: {"sharding_types": ["column_wise"], "min_partition": 4} for t in ("t_user", "t_item", "t_genre")
    },
    "data_parallel": {t: {"sharding_types": ["data_parallel"]} for t in ("t_user", "t_item", "t_genre")},
    "row_wise_mixed": {  # CUDA only
        "t_user": {"sharding_types": ["row_wise"]},
        "t_item": {"sharding_types": ["table_wise"]},
        "t_genre": {"sharding_types": ["data_parallel"]},
    },
    "mixed": {
        "t_user": {"sharding_types": ["column_wise"], "min_partition": 4},
        "t_item": {"sharding_types": ["table_wise"]},
        "t_genre": {"sharding_types": ["data_parallel"]},
    },
}
SCHEDULER = {"gamma": 0.9}


def optimizer_sums(trainer: L.Trainer, module: L.LightningModule) -> dict[str, float]:
    """Per parameter and state, the global sum of the optimizer state (shards summed over ranks, replicas once)."""
    state = canonical_state(trainer.strategy._rec_optimizer, dict(module.named_parameters()))["state"]
    local: dict[str, float] = {}
    for fqn, entries in state.items():
        for name, value in entries.items():
            if isinstance(value, ShardedTensor):
                local[f"{fqn}/{name}"] = sum(float(s.tensor.double().sum()) for s in value.local_shards())
            elif isinstance(value, torch.Tensor) and name != "step" and dist.get_rank() == 0:
                local[f"{fqn}/{name}"] = float(value.double().sum())
    gathered: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, local)
    sums: dict[str, float] = {}
    for part in gathered:
        for key, value in part.items():
            sums[key] = sums.get(key, 0.0) + value
    return dict(sorted(sums.items()))


class RecordRestoredState(L.Callback):
    """Records the optimizer state and learning rates right after a checkpoint was restored."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.lrs: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.sums = optimizer_sums(trainer, pl_module)
        self.lrs = [
            g["lr"] for g in trainer.strategy._rec_optimizer.dense.param_groups
        ] + trainer.strategy._rec_optimizer.embedding_lrs


def fit_epochs(
    rank: int,
    world_size: int,
    out_dir: Path,
    tag: str,
    epochs: int,
    plan: str = "mixed",
    steps: int = 4,
    ckpt_path: str | None = None,
    optimizer: str = "adagrad",
    emb_optimizer: dict[str, Any] | None = None,
    save_every_n_epochs: int = 1,
    accelerator: str = "cpu",
    fail: dict[str, Any] | None = None,
    strategy: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fit ``epochs`` epochs (resuming from ``ckpt_path`` if given) with ModelCheckpoint(save_last, every epoch).
    ``fail``: arguments of a :class:`~lightning_rec.testing.FailAt` callback (a rank fails mid-fit)."""
    from lightning_rec.testing import FailAt

    L.seed_everything(0)
    model = RecModel(optimizer=optimizer, scheduler=SCHEDULER, emb_optimizer=emb_optimizer)
    ckpt_cb = ModelCheckpoint(
        dirpath=out_dir / "ckpts", save_last=True, save_top_k=-1, every_n_epochs=save_every_n_epochs
    )
    restored = RecordRestoredState()
    trainer = make_trainer(
        world_size,
        -1,
        {"constraints": PLANS[plan], **(strategy or {})},
        det_init=ckpt_path is None,
        max_epochs=epochs,
        accelerator=accelerator,
        callbacks=[ckpt_cb, restored] + ([FailAt(out_dir=str(out_dir), **fail)] if fail else []),
    )
    trainer.fit(model, make_loader(rank, steps, 16, {}), ckpt_path=ckpt_path)
    save_weights(model, out_dir, tag, rank)
    return {
        "losses": model.losses,
        "global_step": trainer.global_step,
        "restored_sums": restored.sums,
        "restored_lrs": restored.lrs,
        "final_sums": optimizer_sums(trainer, model),
        "last": ckpt_cb.last_model_path,
    }


def fixed_batch():
    return make_batches(1, 64, seed=999)[0]


def predict_with(world_size: int, plan: str, ckpt: str, accelerator: str = "cpu") -> list[float]:
    """Predictions on :func:`fixed_batch` of a fresh model loaded from ``ckpt`` under ``plan``."""
    trainer = make_trainer(world_size, 1, {"constraints": PLANS[plan]}, det_init=False, accelerator=accelerator)
    out = trainer.predict(RecModel(), DataLoader([fixed_batch()], batch_size=None), ckpt_path=ckpt)
    return [float(x) for x in out[0]]


def reshard(
    rank: int,
    world_size: int,
    out_dir: Path,
    save_plan: str | None,
    load_plans: list[str],
    steps: int = 3,
    accelerator: str = "cpu",
) -> dict[str, Any]:
    """Optionally train + save a checkpoint under ``save_plan`` (predictions recorded), then predict from the
    checkpoint at ``out_dir/saved_<world>.ckpt`` under each of ``load_plans``."""
    out: dict[str, Any] = {}
    if save_plan is not None:
        L.seed_everything(0)
        model = RecModel()
        trainer = make_trainer(world_size, steps, {"constraints": PLANS[save_plan]}, accelerator=accelerator)
        trainer.fit(model, make_loader(rank, steps, 16, {}))
        path = out_dir / f"saved_{world_size}.ckpt"
        trainer.save_checkpoint(path)
        out["saved"] = [float(x) for x in trainer.predict(model, DataLoader([fixed_batch()], batch_size=None))[0]]
        out["saved_sums"] = optimizer_sums(trainer, model)
    sources = sorted(out_dir.glob("saved_*.ckpt"))
    out["loaded"] = {
        f"{src.name}:{plan}": predict_with(world_size, plan, str(src), accelerator)
        for src in sources
        for plan in load_plans
    }
    return out


def resume_on_plans(
    rank: int, world_size: int, out_dir: Path, ckpt: str, plans: list[str], max_steps: int = 6
) -> dict[str, Any]:
    """For each plan: resume fitting from ``ckpt`` (saved on another plan/world size) up to ``max_steps``."""
    out: dict[str, Any] = {}
    for plan in plans:
        L.seed_everything(0)
        model = RecModel()
        restored = RecordRestoredState()
        trainer = make_trainer(world_size, -1, {"constraints": PLANS[plan]}, det_init=False, max_steps=max_steps)
        trainer.callbacks.append(restored)
        trainer.fit(model, make_loader(rank, max_steps, 16, {}, seed=500), ckpt_path=ckpt)
        out[plan] = {"losses": model.losses, "restored_sums": restored.sums, "global_step": trainer.global_step}
    return out


def load_mismatching(rank: int, world_size: int, out_dir: Path, ckpt: str) -> dict[str, Any]:
    """Validate a model whose t_genre table has 13 rows (the checkpoint's has 12) from ``ckpt``: every rank must
    raise the same error, none may hang waiting for the others."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from lightning_rec.checkpoint import CheckpointError
    from tests.helpers.models import tables

    model = RecModel()
    model.ebc = EmbeddingBagCollection(
        tables=[
            *tables()[:2],
            EmbeddingBagConfig(name="t_genre", embedding_dim=8, num_embeddings=13, feature_names=["genre"]),
        ],
        device=torch.device("meta"),
    )
    trainer = make_trainer(world_size, 1, {"constraints": PLANS["mixed"]}, det_init=False)
    try:
        trainer.validate(model, DataLoader([fixed_batch()], batch_size=None), ckpt_path=ckpt)
    except CheckpointError as err:
        return {"error": str(err)}
    return {"error": None}
