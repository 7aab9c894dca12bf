"""recshard under Ray Train, as Ray documents Lightning (issue 46): ``Trainer(strategy="recshard", devices="auto")``
inside a ``TorchTrainer``'s ``train_loop_per_worker`` on a local Ray cluster of 2 CPU workers (gloo), each
checkpoint reported to Ray as the sharded directory, and a worker killed mid-epoch resumed by Ray from the last
reported checkpoint to the weights of an uninterrupted run.

One local Ray cluster for the module; the uninterrupted run is a module fixture that the other tests compare with.
The train loop below is the one docs/scaling-out.md shows.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_rec.checkpoint import is_checkpoint
from lightning_rec.data import SyntheticDataModule, SyntheticTable
from lightning_rec.models import DLRMModule
from lightning_rec.testing import QUIET_TRAINER, FailAt
from tests.helpers.dist import REPO
from tests.helpers.models import assemble, local_weights

if not os.environ.get("CI"):  # CI installs the `ray` extra (scripts/setup.sh) and must run these
    pytest.importorskip("ray.train", reason='needs the `ray` extra: pip install -e ".[ray]"')
import ray
import ray.train
from ray.train.torch import TorchTrainer

from lightning_rec.integrations.ray import RayTrainReportCallback, prepare_trainer, restored_checkpoint

pytestmark = pytest.mark.dist

STEPS_PER_EPOCH = 12  # per worker: 12 batches of 8 rows
EPOCHS = 2
EVERY = 5  # report a checkpoint every 5 steps: at 5, 10 (epoch 0), 15, 20 (epoch 1)
KILL_AT = 17  # rank 1 SIGKILLs itself at step 17, on the first attempt only: the last report was at step 15


class _Starts(L.Callback):
    """Records, per rank, where each attempt started: the ``ckpt_path`` it was given and its first global step."""

    def __init__(self, out: Path, tag: str, ckpt_path: str | None) -> None:
        self.out, self.tag, self.ckpt_path = out, tag, ckpt_path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with open(self.out / f"{self.tag}.starts.rank{trainer.global_rank}", "a") as f:
            f.write(f"{trainer.global_step} {self.ckpt_path}\n")


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The Ray Train loop: a DLRM on synthetic rows, ``strategy="recshard"``, ``devices="auto"``."""
    out, tag = Path(config["out"]), config["tag"]
    L.seed_everything(0)
    datamodule = SyntheticDataModule(
        [SyntheticTable("item", 200, distribution="power_law"), SyntheticTable("tags", 30, multi_hot=True)],
        num_dense_features=2,
        train_rows=STEPS_PER_EPOCH * 8 * 2,
        batch_size=8,
    )
    model = DLRMModule(
        sparse_features=datamodule.sparse_features,
        num_dense_features=datamodule.num_dense_features,
        embedding_dim=8,
        dense_arch_layer_sizes=[8],
        over_arch_layer_sizes=[8, 1],
    )
    callbacks: list[L.Callback] = [RayTrainReportCallback(every_n_train_steps=EVERY)]
    if config.get("kill_at"):
        callbacks.append(FailAt(rank=1, step=config["kill_at"], how="kill", out_dir=out, once=True))
    with restored_checkpoint() as ckpt_path:
        trainer = L.Trainer(
            strategy="recshard",
            devices="auto",
            max_epochs=EPOCHS,
            limit_val_batches=0,
            callbacks=[*callbacks, _Starts(out, tag, ckpt_path)],
            **QUIET_TRAINER,
        )
        trainer = prepare_trainer(trainer)
        trainer.fit(model, datamodule, ckpt_path=ckpt_path)
    torch.save(local_weights(model), out / f"{tag}.weights{trainer.global_rank}.pt")


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster (2 CPUs) for the module; the workers import the tests from the repository."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        # Ray Train's controller polls the workers every 2 s by default: its reports are committed, and a dead
        # worker found, that much sooner.
        runtime_env={
            "env_vars": {
                "PYTHONPATH": str(REPO),
                "PYTHONWARNINGS": "ignore",
                "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
            }
        },
    )
    yield
    ray.shutdown()


def _fit(out: Path, tag: str, max_failures: int = 0, **config: Any) -> ray.train.Result:
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"out": str(out), "tag": tag, **config},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(
            name=tag,
            storage_path=str(out / "ray_results"),
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
        ),
    )
    return trainer.fit()


def _starts(out: Path, tag: str, rank: int) -> list[tuple[int, str]]:
    lines = (out / f"{tag}.starts.rank{rank}").read_text().splitlines()
    return [(int(step), path) for step, path in (line.split(" ", 1) for line in lines)]


def _weights(out: Path, tag: str) -> dict[str, torch.Tensor]:
    return assemble([torch.load(out / f"{tag}.weights{r}.pt") for r in range(2)])


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory) -> tuple[Path, ray.train.Result]:
    out = tmp_path_factory.mktemp("ray_uninterrupted")
    return out, _fit(out, "uninterrupted")


def test_devices_auto_trains_on_two_workers_and_reports_sharded_directories(uninterrupted):
    out, result = uninterrupted
    assert result.error is None
    # Both workers trained every step of both epochs from scratch, on Ray's ranks (2 of them).
    assert _starts(out, "uninterrupted", 0) == _starts(out, "uninterrupted", 1) == [(0, "None")]
    reported = sorted(int(metrics["step"]) for _, metrics in result.best_checkpoints)
    assert reported == list(range(EVERY, STEPS_PER_EPOCH * EPOCHS + 1, EVERY))
    # What Ray keeps is recshard's sharded directory, each rank's shards in it, loadable as a checkpoint.
    kept = Path(result.checkpoint.path)
    assert is_checkpoint(kept), sorted(p.name for p in kept.iterdir())
    assert {re.match(r"__(\d+)_\d+\.distcp$", p.name)[1] for p in kept.glob("__*.distcp")} == {"0", "1"}
    assert len(_weights(out, "uninterrupted")) > 0


def test_a_killed_worker_resumes_from_the_last_reported_checkpoint(uninterrupted, tmp_path):
    reference_out, _ = uninterrupted
    result = _fit(tmp_path, "restarted", max_failures=1, kill_at=KILL_AT)
    assert result.error is None
    assert (tmp_path / "failed.rank1").exists(), "rank 1 was killed once"
    last_before_kill = max(s for s in range(EVERY, KILL_AT, EVERY))
    kept = {int(metrics["step"]): Path(checkpoint.path) for checkpoint, metrics in result.best_checkpoints}
    for rank in range(2):
        first, second = _starts(tmp_path, "restarted", rank)
        assert first == (0, "None")
        # Ray restarted the group from the checkpoint it holds for the last report before the kill.
        assert second == (last_before_kill, str(kept[last_before_kill]))
    got, want = _weights(tmp_path, "restarted"), _weights(reference_out, "uninterrupted")
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
