"""recshard on a Ray cluster: Ray Train starts the workers, keeps the sharded checkpoints and restarts after failures.

    pip install "lightning_rec[ray]"
    python examples/ray_train.py                        # a local Ray cluster, 2 CPU workers
    python examples/ray_train.py --address auto         # the Ray cluster this machine belongs to

docs/scaling-out.md ("Ray Train") shows this file; tests/integrations/test_ray.py runs it (``run``), with a worker
killed mid-epoch.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import ray
import ray.train
from ray.train.torch import TorchTrainer

from lightning_rec.data import SyntheticDataModule, SyntheticTable
from lightning_rec.integrations.ray import RayTrainReportCallback, prepare_trainer, restored_checkpoint
from lightning_rec.models import DLRMModule


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """What every Ray Train worker runs: a plain Lightning fit with ``strategy="recshard"``."""
    L.seed_everything(0)
    datamodule = SyntheticDataModule(
        [SyntheticTable("item", 200, distribution="power_law"), SyntheticTable("tags", 30, multi_hot=True)],
        num_dense_features=2,
        train_rows=config["train_rows"],
        val_rows=config["val_rows"],  # validated at the end of each epoch
        batch_size=8,
    )
    model = DLRMModule(
        sparse_features=datamodule.sparse_features,
        num_dense_features=datamodule.num_dense_features,
        embedding_dim=8,
        dense_arch_layer_sizes=[8],
        over_arch_layer_sizes=[8, 1],
    )
    trainer = L.Trainer(
        strategy="recshard",
        devices="auto",  # Ray gives each worker its device: the CPU, or its GPU with ScalingConfig(use_gpu=True)
        max_epochs=config["max_epochs"],
        enable_checkpointing=False,  # Ray keeps the checkpoints the callback reports
        callbacks=[RayTrainReportCallback(every_n_train_steps=config["report_every"]), *config.get("callbacks", [])],
        logger=False,
        enable_progress_bar=False,
    )
    trainer = prepare_trainer(trainer)
    with restored_checkpoint() as ckpt_path:  # None on a first start; after a failure, the last checkpoint reported
        trainer.fit(model, datamodule, ckpt_path=ckpt_path)


def run(
    workers: int = 2,
    max_failures: int = 1,
    storage_path: str | None = None,
    name: str | None = None,
    **config: Any,
) -> ray.train.Result:
    """Train on ``workers`` Ray workers; Ray restarts them up to ``max_failures`` times from the last checkpoint.

    Args:
        workers: how many workers (one rank each).
        max_failures: how many failures Ray recovers from.
        storage_path: where Ray keeps the run and its checkpoints (default: ``~/ray_results``); a shared
            filesystem or ``s3://...`` on a multi-node cluster.
        name: the run's name (a folder of ``storage_path``).
        config: ``train_loop_per_worker``'s config: ``train_rows``, ``val_rows``, ``max_epochs``, ``report_every``
            (the defaults below), ``callbacks`` (more Lightning callbacks).

    Returns:
        Ray's result: ``result.checkpoint`` is the last sharded checkpoint directory reported.
    """
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "train_rows": 192 * workers,
            "val_rows": 64 * workers,
            "max_epochs": 2,
            "report_every": 5,
            **config,
        },
        scaling_config=ray.train.ScalingConfig(num_workers=workers),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=storage_path,
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
        ),
    )
    return trainer.fit()


def main(argv: list[str] | None = None) -> None:
    """``python examples/ray_train.py [--address auto] [--workers 2] [--max-failures 1] [--storage-path PATH]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None, help="a Ray cluster to join (default: start a local one)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-failures", type=int, default=1)
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args(argv)
    ray.init(address=args.address)
    result = run(args.workers, args.max_failures, args.storage_path)
    print(f"last checkpoint: {result.checkpoint.path}")


if __name__ == "__main__":
    main()
