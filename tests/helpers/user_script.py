"""A user's training script, written for Lightning and nothing else: ``python -m tests.helpers.user_script
--strategy recshard|ddp --out DIR``.

It builds ``Trainer(devices=2)``, records what the trainer says about ranks at every point of its life (right after
``Trainer(...)``, in ``setup``, at ``on_fit_start``, after ``fit``), splits its data by ``trainer.global_rank``
before ``fit`` (as scripts do), trains, reduces a metric a few times after ``fit``, and ends: no barrier,
no ``destroy_process_group``, no ``os._exit``. Started plainly, Lightning's launcher re-runs it for rank 1; under
torchrun each rank runs it.
"""

import argparse
import atexit
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader

from tests.helpers.user_models import ValuesModel, global_batches, rank_share, to_batch


def ranks(trainer: L.Trainer) -> dict[str, Any]:
    return {
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "world_size": trainer.world_size,
        "is_global_zero": trainer.is_global_zero,
        "num_devices": trainer.num_devices,
        "num_nodes": trainer.num_nodes,
        "rank_zero_only": rank_zero_only.rank,
        "sampler": trainer.strategy.distributed_sampler_kwargs,
    }


class Record(L.Callback):
    def __init__(self, seen: list[Any]) -> None:
        self.seen = seen

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.seen.append(["setup", ranks(trainer)])

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen.append(["on_fit_start", ranks(trainer)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="recshard")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--collectives", type=int, default=30, help="reductions after fit (a script's metrics)")
    args = parser.parse_args()
    import lightning_rec  # noqa: F401  (registers "recshard")

    seen: list[Any] = []
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[Record(seen)],
    )
    seen.append(["after Trainer()", ranks(trainer)])
    exit_record = Path(args.out, f"{args.strategy}.rank{trainer.global_rank}.exit.json")
    # Registered before fit, so it runs after any exit handler the strategy registers during fit (LIFO).
    atexit.register(lambda: exit_record.write_text(json.dumps({"process_group_alive": dist.is_initialized()})))
    # Split by rank before fit, as user scripts do: this rank's share of every global batch.
    share = [to_batch(rank_share(b, trainer.global_rank, trainer.world_size)) for b in global_batches(args.steps, 8)]
    model = ValuesModel()
    trainer.fit(model, DataLoader(share, batch_size=None))
    seen.append(["after fit", ranks(trainer)])
    total = torch.zeros(1)
    for _ in range(args.collectives):
        total += trainer.strategy.reduce(torch.ones(1), reduce_op="sum")
    out = {"seen": seen, "losses": model.losses, "reduced": float(total), "threads": torch.get_num_threads()}
    Path(args.out, f"{args.strategy}.rank{trainer.global_rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
