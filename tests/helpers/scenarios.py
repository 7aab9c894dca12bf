"""What one rank does in a multi-process test. Each function returns a JSON-serialisable dict."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_rec import RecShardStrategy
from lightning_rec._planner.table import plan_rows
from lightning_rec._strategy.faults import close_process_group_at_exit
from lightning_rec._strategy.optim import is_fused_parameter
from lightning_rec.testing import QUIET_TRAINER, deterministic_init
from tests.helpers.models import RecModel, as_format, local_weights, make_batches, save_weights


class DeterministicInit(L.Callback):
    """Start every run from the same weights, whatever the plan or RNG history (see lightning_rec.testing.init.pattern)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        deterministic_init(pl_module)


# A plan with a column-wise, a table-wise and a replicated table (the planner alone would replicate tables
# this small).
MIXED_PLAN = {
    "t_user": {"sharding_types": ["column_wise"]},
    "t_item": {"sharding_types": ["table_wise"]},
    "t_genre": {"sharding_types": ["data_parallel"]},
}


def make_trainer(
    world_size: int, steps: int, strategy: dict[str, Any] | None = None, det_init: bool = True, **kwargs: Any
) -> L.Trainer:
    num_nodes = kwargs.pop("num_nodes", 1)
    defaults = dict(
        accelerator="cpu",
        devices=world_size // num_nodes,
        num_nodes=num_nodes,
        max_steps=steps,
        **QUIET_TRAINER,
    )
    extra_callbacks = kwargs.pop("callbacks", [])
    if any(isinstance(c, ModelCheckpoint) for c in extra_callbacks):
        kwargs["enable_checkpointing"] = True
    defaults.update(kwargs)
    return L.Trainer(
        strategy=RecShardStrategy(**{"constraints": MIXED_PLAN, **(strategy or {})}),
        callbacks=([DeterministicInit()] if det_init else []) + list(extra_callbacks),
        **defaults,
    )


def make_loader(
    rank: int,
    steps: int,
    batch_size: int | list[int],
    model: dict[str, Any],
    num_workers: int = 0,
    seed: int = 100,
) -> DataLoader:
    """``steps`` batches of ``batch_size`` samples (a list: one size per rank), different on every rank."""
    fmt = model.get("batch_format", "batch")
    batch_size = batch_size if isinstance(batch_size, int) else batch_size[rank]
    batches = [
        as_format(b, fmt)
        for b in make_batches(steps, batch_size, seed=seed + rank, with_ec=model.get("with_ec", False))
    ]
    # spawn, not fork: forking a process whose gloo threads are running can deadlock the child.
    context = "spawn" if num_workers > 0 else None
    return DataLoader(batches, batch_size=None, num_workers=num_workers, multiprocessing_context=context)


def train(
    rank: int,
    world_size: int,
    out_dir: Path,
    tag: str = "train",
    steps: int = 8,
    batch_size: int | list[int] = 32,
    model: dict[str, Any] | None = None,
    strategy: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
    num_workers: int = 0,
    epochs: int = 1,
) -> dict[str, Any]:
    """Fit a RecModel with recshard; report losses, closure calls, learning rates, plan; save local weights."""
    model = model or {}
    L.seed_everything(0)
    m = RecModel(**model)
    tr = make_trainer(world_size, steps * epochs, strategy, **(trainer or {}))
    tr.fit(m, make_loader(rank, steps, batch_size, model, num_workers))
    save_weights(m, out_dir, tag, rank)
    plan = tr.strategy.sharding_plan
    if rank == 0:
        torch.save(plan, out_dir / f"{tag}.plan.pt")
    rec = tr.strategy._rec_optimizer
    report = tr.strategy.plan_report
    dense_params = [p for g in rec.dense.param_groups for p in g["params"]]
    emb_names = {n for n, p in m.named_parameters() if is_fused_parameter(p)}
    return {
        "losses": m.losses,
        "closure_calls": m.closure_calls,
        "global_step": tr.global_step,
        "fused_lrs": m.fused_lrs,
        "dense_lr": rec.dense.param_groups[0]["lr"],
        "plan": [dataclasses.asdict(r) for r in plan_rows(plan)],
        "dense_param_count": len(dense_params),
        "dense_has_fused": any(is_fused_parameter(p) for p in dense_params),
        "num_model_params": sum(1 for n, p in m.named_parameters() if n not in emb_names),
        "train_loss_logged": float(tr.callback_metrics["train_loss"]) if "train_loss" in tr.callback_metrics else None,
        "environment": type(tr.strategy.cluster_environment).__name__,
        "node_rank": tr.node_rank,
        "local_rank": tr.local_rank,
        "planner_topology": {"world_size": report.world_size, "local_world_size": report.local_world_size},
    }


def fit_error(rank: int, world_size: int, out_dir: Path, **kwargs: Any) -> dict[str, Any]:
    """Like :func:`train`, but report the exception instead of failing."""
    try:
        train(rank, world_size, out_dir, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def reference(
    rank: int,
    world_size: int,
    out_dir: Path,
    plan_from: str,
    tag: str = "reference",
    steps: int = 8,
    batch_size: int | list[int] = 32,
    lr: float = 0.1,
    model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The hand-written TorchRec loop a TorchRec user would write: DMP + CombinedOptimizer, same plan and data."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from lightning_rec.testing.reference import reference_dmp, reference_optimizer

    model = model or {}
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    m = RecModel(**model)
    plan = torch.load(out_dir / f"{plan_from}.plan.pt", weights_only=False)
    fused = {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": lr, "eps": 1e-10}  # torch Adagrad's eps
    sharders = [EmbeddingBagCollectionSharder(fused_params=fused), EmbeddingCollectionSharder(fused_params=fused)]
    dmp = reference_dmp(m, sharders, torch.device("cpu"), plan=plan)
    deterministic_init(dmp.module)
    opt = reference_optimizer(dmp, lambda ps: torch.optim.Adagrad(ps, lr=lr))
    losses: list[float] = []
    for b in make_loader(rank, steps, batch_size, model):
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(dmp(b), b.labels)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    save_weights(dmp.module, out_dir, tag, rank)
    kernels = sorted({ps.compute_kernel for mp in dmp.plan.plan.values() for ps in mp.values()})
    # Without it, gloo's worker threads can abort the process at exit; destroy_process_group alone does not stop them
    # while DMP still references the group (see lightning_rec._strategy.faults.close_process_group_at_exit).
    close_process_group_at_exit()
    return {"losses": losses, "kernels": kernels}


def loops(rank: int, world_size: int, out_dir: Path, steps: int = 4, batch_size: int = 16) -> dict[str, Any]:
    """fit (with validation), then validate, test and predict on the sharded model; plus the collectives."""
    L.seed_everything(0)
    m = RecModel()
    tr = make_trainer(world_size, steps, limit_val_batches=2)
    train_loader = make_loader(rank, steps, batch_size, {})
    val_loader = make_loader(rank, 2, batch_size, {}, seed=500)
    tr.fit(m, train_loader, val_loader)
    calls_after_fit = m.closure_calls
    before = local_weights(m)
    local_val = [float(m.loss(b)) for b in val_loader]
    val = tr.validate(m, val_loader, verbose=False)[0]
    test = tr.test(m, val_loader, verbose=False)[0]
    preds = tr.predict(m, val_loader)
    after = local_weights(m)
    unchanged = all(torch.equal(a[1], b[1]) for k in before for a, b in zip(before[k], after[k]))

    s = tr.strategy
    x = torch.tensor([float(rank + 1)])
    return {
        "val_loss": val["val_loss"],
        "test_loss": test["test_loss"],
        "local_val_mean": sum(local_val) / len(local_val),
        "closure_calls_after_fit": calls_after_fit,
        "closure_calls_end": m.closure_calls,
        "weights_unchanged_by_eval": unchanged,
        "num_predictions": sum(p.numel() for p in preds),
        "predictions_in_range": all(bool(((p >= 0) & (p <= 1)).all()) for p in preds),
        "reduce": {op: float(s.reduce(x.clone(), reduce_op=op)) for op in ("sum", "mean", "max", "min")},
        "all_gather": s.all_gather(torch.tensor([rank * 10])).reshape(-1).tolist(),
        "broadcast_from_last": s.broadcast({"from": rank}, src=world_size - 1),
        "is_global_zero": s.is_global_zero,
    }


def fit_errors(rank: int, world_size: int, out_dir: Path, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Run several misconfigured fits in one process; report each one's error (or None)."""
    return {"errors": [fit_error(rank, world_size, out_dir, **case)["error"] for case in cases]}


def dense_only(rank: int, world_size: int, out_dir: Path, steps: int = 20) -> dict[str, Any]:
    """A model without embedding tables falls back to plain data parallel (with a warning) and trains."""
    import warnings

    class Dense(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return F.binary_cross_entropy_with_logits(self.net(batch.dense_features).squeeze(1), batch.labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    L.seed_everything(0)
    m = Dense()
    batches = make_batches(steps, 64, seed=rank)
    for b in batches:  # a learnable dense task
        b.labels = (b.dense_features[:, 0] > 0.5).float()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = make_trainer(world_size, steps, strategy={"constraints": {}}, det_init=False)
        tr.fit(m, DataLoader(batches, batch_size=None))
    weights = [float(v) for v in m.net.weight.detach().reshape(-1)]
    return {
        "warned": any("nothing to shard" in str(w.message) for w in caught),
        "weights": weights,
        "global_step": tr.global_step,
    }


def validate_then_fit(rank: int, world_size: int, out_dir: Path, steps: int = 4) -> dict[str, Any]:
    """A common sanity pattern: validate a fresh model first (shards it), then fit the same model."""
    L.seed_everything(0)
    m = RecModel(lr=0.3)
    tr = make_trainer(world_size, steps, det_init=False)  # keep the weights `before` was measured on
    loader = make_loader(rank, steps, 16, {})
    before = tr.validate(m, loader, verbose=False)[0]["val_loss"]
    tr.fit(m, loader)
    after = tr.validate(m, loader, verbose=False)[0]["val_loss"]
    return {"before": before, "after": after, "steps": tr.global_step, "fused_lrs": m.fused_lrs}
