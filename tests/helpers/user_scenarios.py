"""Per-rank scenarios with the user-written model of :mod:`tests.helpers.user_models` (run through
``tests.helpers.dist.run_ranks`` as ``tests.helpers.user_scenarios:<function>``).

Every scenario trains or predicts the way a user script does: ``logger=False``, dict batches, each rank taking its
share of every global batch.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_rec import RecShardStrategy
from lightning_rec._strategy.faults import close_process_group_at_exit
from tests.helpers.models import local_weights, plan_shards, sharded_forwards
from tests.helpers.user_models import (
    TABLE_WISE_PLAN,
    ValuesModel,
    global_batches,
    rank_share,
    reference,
    samples,
    to_batch,
)

LR = 0.05
HELDOUT_SEED = 99


class _Probe(L.Callback):
    """Records the sharded weights before the first update, whether the output order needed restoring and, at every
    training step, which forward the sharded EBC ran (``PipelinedForward`` when TorchRec's pipeline rewrote it)."""

    def __init__(self, out: Path, rank: int) -> None:
        self.out, self.rank = out, rank
        self.reordered: bool | None = None
        self.forwards: list[str] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save(local_weights(pl_module), self.out / f"start.weights{self.rank}.pt")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.reordered is None:  # after the first forward the wrapper is gone unless it reorders
            self.reordered = "compute_and_output_dist" in vars(pl_module.ebc)
        self.forwards.append(sharded_forwards(pl_module)["ebc"])


def _trainer(
    world_size: int, steps: int, sync_batchnorm: bool = False, accelerator: str = "cpu", **strategy: Any
) -> L.Trainer:
    return L.Trainer(
        strategy=RecShardStrategy(**strategy),
        accelerator=accelerator,
        devices=world_size,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        sync_batchnorm=sync_batchnorm,
    )


def _heldout(rank: int, world_size: int, fmt: str = "dict") -> DataLoader:
    return DataLoader([to_batch(rank_share(samples(16, HELDOUT_SEED), rank, world_size), fmt)], batch_size=None)


def fit(
    rank: int,
    world_size: int,
    out_dir: Path,
    constraints: dict[str, Any] | None = None,
    pipeline: bool = False,
    steps: int = 5,
    batch_size: int = 16,
    save: str | None = None,
    fmt: str = "dict",
    rows_per_rank: bool = False,
    sync_batchnorm: bool = False,
) -> dict[str, Any]:
    """Fit :class:`ValuesModel` on this rank's share of every global batch; predict the held-out rows; rank 0 also
    computes the plain-PyTorch reference on whole batches (from its own rows: with ``rows_per_rank`` every rank
    builds its tables from other rows, and training must start from rank 0's, as DDP does)."""
    L.seed_everything(0)
    model = ValuesModel(seed=7 + (rank if rows_per_rank else 0), lr=LR, fmt=fmt, batchnorm=sync_batchnorm)
    batches = global_batches(steps, batch_size)
    result: dict[str, Any] = {}
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, out_dir / "held.pt")
        result["ref_losses"], result["ref_logits"] = reference(model, batches, samples(16, HELDOUT_SEED), LR)
    probe = _Probe(out_dir, rank)
    trainer = _trainer(world_size, steps, constraints=constraints, pipeline=pipeline, sync_batchnorm=sync_batchnorm)
    trainer.callbacks.append(probe)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(
            model, DataLoader([to_batch(rank_share(b, rank, world_size), fmt) for b in batches], batch_size=None)
        )
    if save:
        trainer.save_checkpoint(out_dir / save)
    logits = torch.cat(trainer.predict(model, _heldout(rank, world_size, fmt))).tolist()
    return {
        **result,
        "losses": model.losses,
        "logits": logits,
        "reordered": probe.reordered,
        "forwards": probe.forwards,
        "shards": {t: s["offsets"] for t, s in plan_shards(trainer.strategy.sharding_plan).items()},
        "warnings": [str(w.message) for w in caught if "different weights on different ranks" in str(w.message)],
    }


def predict_from(
    rank: int, world_size: int, out_dir: Path, ckpt: str, constraints: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A fresh model (other rows: they must come from the checkpoint) predicts the held-out rows with
    ``trainer.predict(ckpt_path=...)``."""
    L.seed_everything(0)
    model = ValuesModel(seed=1234, lr=LR)
    trainer = _trainer(world_size, 1, constraints=constraints)
    logits = torch.cat(trainer.predict(model, _heldout(rank, world_size), ckpt_path=str(out_dir / ckpt))).tolist()
    return {"logits": logits}


def ec_order(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    """An EmbeddingCollection (user, genre, item) under a plan that groups them by sharding type: the keys of its
    output dict, sharded, and the unsharded module's outputs for comparison."""
    from torchrec import EmbeddingCollection, EmbeddingConfig

    from tests.helpers.user_models import TABLES

    class Sequences(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.ec = EmbeddingCollection(
                tables=[
                    EmbeddingConfig(name=t, embedding_dim=8, num_embeddings=n, feature_names=[f]) for t, f, n in TABLES
                ],
                device=torch.device("cpu"),
            )

        def predict_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            out = dict(self.ec(batch["sparse"]).items())  # a sharded EC returns a LazyAwaitable of the dict
            return {"keys": list(out), "values": [jt.values() for jt in out.values()]}

    L.seed_everything(0)
    model = Sequences()
    batch = to_batch(samples(8, HELDOUT_SEED))
    with torch.no_grad():
        unsharded = {k: jt.values().tolist() for k, jt in model.ec(batch["sparse"]).items()}
    plan = {
        "t_user": {"sharding_types": ["column_wise"]},
        "t_genre": {"sharding_types": ["table_wise"]},
        "t_item": {"sharding_types": ["column_wise"]},
    }
    out = _trainer(world_size, 1, constraints=plan).predict(model, DataLoader([batch], batch_size=None))[0]
    return {
        "unsharded_keys": list(unsharded),
        "sharded_keys": out["keys"],
        "same_values": all(torch.equal(torch.tensor(unsharded[k]), v) for k, v in zip(out["keys"], out["values"])),
    }


class _BatchValuesModel(ValuesModel):
    """:class:`ValuesModel` on TorchRec's ``Batch`` (what TorchRec's own train pipeline takes)."""

    def forward(self, batch: Any) -> torch.Tensor:
        return self.over(torch.cat([self.ebc(batch.sparse_features).values(), batch.dense_features], dim=1)).squeeze(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(self(batch), batch.labels)
        self.losses.append(loss.item())
        return loss


def _sync_batches(rank: int, world_size: int, steps: int, fmt: str) -> list[Any]:
    from torchrec.datasets.utils import Batch

    batches = [to_batch(rank_share(b, rank, world_size)) for b in global_batches(steps, 16)]
    if fmt == "batch":
        return [Batch(dense_features=b["dense"], sparse_features=b["sparse"], labels=b["label"]) for b in batches]
    return batches


class _Window:
    """Turns counting on and off: the dispatch-level :class:`~lightning_rec.testing.SyncCounter` and, on CUDA,
    torch's own sync detector (``torch.cuda.set_sync_debug_mode``, one warning per synchronizing call)."""

    def __init__(self, counter: Any, caught: list[Any]) -> None:
        self.counter, self.caught, self.cuda, self._since = counter, caught, 0, 0

    def set(self, active: bool) -> None:
        if active and not self.counter.active:
            self._since = len(self.caught)
        elif not active and self.counter.active:
            self.cuda += sum("synchronizing" in str(w.message) for w in self.caught[self._since :])
        self.counter.active = active


def syncs(
    rank: int,
    world_size: int,
    out_dir: Path,
    pipeline: bool = False,
    steps: int = 8,
    fmt: str = "dict",
    loop: str = "recshard",
    accelerator: str = "cpu",
) -> dict[str, Any]:
    """Count host syncs per training step (steps 3 to ``steps`` - 2), by who asked for them, in a recshard fit
    (``loop="recshard"``) or in the hand-written TorchRec loop of the same model (``loop="raw"``: DMP, fused
    Adagrad for the tables and torch's for the rest in a ``CombinedOptimizer``; ``TrainPipelineSparseDist`` with
    ``pipeline``). Both call ``loss.item()`` once per step, as the model's ``training_step`` does. On CUDA
    (``accelerator="gpu"``) torch's sync detector counts too (``cuda_per_step``)."""
    from lightning_rec.testing import SyncCounter

    counter = SyncCounter()
    counter.active = False
    L.seed_everything(0)
    model = (_BatchValuesModel if fmt == "batch" else ValuesModel)(lr=LR)
    batches = _sync_batches(rank, world_size, steps, fmt)
    cuda = accelerator == "gpu"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        window = _Window(counter, caught)
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        if loop == "raw":
            with counter:
                _raw_torchrec_loop(model, batches, window, pipeline, torch.device("cuda" if cuda else "cpu"))
        else:

            class Window(L.Callback):
                def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
                    window.set(3 <= trainer.global_step < steps - 1)  # steps 3 to steps - 2, as the raw loop

            trainer = _trainer(
                world_size, steps - 1, constraints=TABLE_WISE_PLAN, pipeline=pipeline, accelerator=accelerator
            )
            trainer.callbacks.append(Window())
            with counter:
                trainer.fit(model, DataLoader(batches, batch_size=None, pin_memory=cuda))
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    measured = steps - 4
    return {
        "per_step": counter.count / measured,
        "cuda_per_step": window.cuda / measured,
        "lightning_rec": counter.count_from("/lightning_rec/") / measured,
        "lightning_rec_functions": sorted({fn for (_, (f, _, fn)) in counter.origins if "/lightning_rec/" in f}),
        "lightning_loop": counter.count_from("/lightning/pytorch/loops/") / measured,
        "lightning_loop_functions": sorted(
            {fn for (_, (f, _, fn)) in counter.origins if "/lightning/pytorch/loops/" in f}
        ),
        "by_op": {op: n / measured for op, n in sorted(_by_op(counter).items())},
        # per step, by op and the file and function that asked (no line numbers: they move with every release)
        "by_origin": _by_origin(counter, measured),
        "origins": sorted(
            f"{op} {Path(f).name}:{line} {fn} x{n}" for (op, (f, line, fn)), n in counter.origins.items()
        ),
    }


def _by_origin(counter: Any, steps: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for (op, (file, _, function)), n in counter.origins.items():
        mine = file.replace("\\", "/").rpartition("/lightning_rec/")
        key = f"{op} {'lightning_rec/' + mine[2] if mine[1] else Path(file).name}:{function}"
        out[key] = out.get(key, 0) + n / steps
    return dict(sorted(out.items()))


def _by_op(counter: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for (op, _), n in counter.origins.items():
        out[op] = out.get(op, 0) + n
    return out


def _raw_torchrec_loop(model: Any, batches: list[Any], window: _Window, pipeline: bool, device: torch.device) -> None:
    """TorchRec by hand, as its tutorials write it; ``window`` counts steps 3 to len(batches) - 2."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torch import nn
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from lightning_rec.testing.reference import reference_dmp, reference_optimizer

    class WithLoss(nn.Module):  # TorchRec's pipeline wants forward(batch) -> (loss, output)
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, batch: Any) -> Any:
            logits = self.inner(batch)
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            return loss, (loss.detach(), logits.detach())  # progress() returns the second part

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": LR, "eps": 1e-10}
    )
    root = WithLoss(model) if pipeline else model
    dmp = reference_dmp(root, [sharder], device, TABLE_WISE_PLAN)
    optimizer = reference_optimizer(dmp, lambda ps: torch.optim.Adagrad(ps, lr=LR))
    loader = DataLoader(batches, batch_size=None, pin_memory=device.type == "cuda")
    if pipeline:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        engine = TrainPipelineSparseDist(dmp, optimizer, device, execute_all_batches=True)
        it = iter(loader)
        for step in range(len(batches) - 1):
            window.set(3 <= step < len(batches) - 1)
            loss, _ = engine.progress(it)
            loss.item()
    else:
        for step, batch in enumerate(loader):
            if step == len(batches) - 1:
                break
            window.set(3 <= step)
            batch = (
                batch.to(device, non_blocking=True)
                if not isinstance(batch, dict)
                else {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            )
            optimizer.zero_grad()
            label = batch.labels if not isinstance(batch, dict) else batch["label"]
            loss = F.binary_cross_entropy_with_logits(dmp(batch), label)
            loss.backward()
            optimizer.step()
            loss.item()
    window.set(False)
    close_process_group_at_exit()  # a clean exit for the hand-written loop's gloo group (lightning_rec._strategy.faults)


class _HookedValuesModel(ValuesModel):
    """:class:`ValuesModel` whose DataLoader gives raw ids, turned into its KJT batch by ``on_before_batch_transfer``
    (on the host), with Lightning's other two transfer hooks overridden too. ``bad_step``: the hook makes an id of
    feature 'user' too large at that step."""

    def __init__(self, bad_step: int = -1) -> None:
        super().__init__(lr=LR)
        self.bad_step, self.transfers, self.after = bad_step, 0, 0

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        rows = batch["rows"]
        if self.trainer.training and self.trainer.global_step == self.bad_step:
            rows = [dict(rows[0], user=[60 + 5]), *rows[1:]]
        return to_batch(rows)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        self.transfers += 1
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.after += 1
        return batch


def transfer_hooks(rank: int, world_size: int, out_dir: Path, bad_step: int = -1, steps: int = 5) -> dict[str, Any]:
    """Fit :class:`_HookedValuesModel` on raw rows; the plain-PyTorch reference on the same batches."""
    L.seed_everything(0)
    model = _HookedValuesModel(bad_step)
    batches = global_batches(steps, 16)
    ref_losses, _ = reference(model, batches, samples(4, HELDOUT_SEED), LR)
    error = None
    try:
        _trainer(world_size, steps, constraints=TABLE_WISE_PLAN).fit(
            model, DataLoader([{"rows": rows} for rows in batches], batch_size=None, collate_fn=lambda b: b)
        )
    except Exception as e:  # noqa: BLE001 - the test inspects it
        error = f"{type(e).__name__}: {e}"
    return {
        "losses": model.losses,
        "ref_losses": ref_losses,
        "transfers": model.transfers,
        "after": model.after,
        "error": error,
    }
