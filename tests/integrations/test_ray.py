"""recshard under Ray Train, as Ray documents Lightning (issue 46): ``Trainer(strategy="recshard", devices="auto")``
inside a ``TorchTrainer``'s ``train_loop_per_worker`` on a local Ray cluster of 2 CPU workers (gloo), each
checkpoint reported to Ray as the sharded directory, and a worker killed mid-epoch resumed by Ray from the last
reported checkpoint to the weights of an uninterrupted run.

What runs is ``examples/ray_train.py`` (docs/scaling-out.md shows it), made small, with the test's callbacks added
(where each attempt started, each rank's weights, the kill). One local Ray cluster for the module; the uninterrupted
run is a module fixture that the killed one is compared with.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import pytest
import torch

from lightning_rec.checkpoint import is_checkpoint
from lightning_rec.testing import FailAt
from tests.helpers.dist import REPO
from tests.helpers.models import assemble, local_weights

if TYPE_CHECKING:
    import ray.train

pytestmark = pytest.mark.dist

STEPS_PER_EPOCH = 6  # per worker: 6 batches of 8 rows
EPOCHS = 2
EVERY = 4  # a checkpoint reported every 4 steps: at 4 (epoch 0), 8 (epoch 1, mid-epoch) and 12
VAL_ROWS = 16  # one batch per worker at the end of each epoch: the validation is not what is tested here
KILL_AT = 9  # rank 1 SIGKILLs itself at step 9, on the first attempt only: the last report was at step 8


class _Record(L.Callback):
    """Per rank: where each attempt started (its first step, the ``ckpt_path`` it resumed, Ray's ranks as the
    strategy sees them), and the rank's weights at the end."""

    def __init__(self, out: Path, tag: str) -> None:
        self.out, self.tag = out, tag

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        seen = (trainer.world_size, strategy.num_processes, str(strategy.root_device))  # type: ignore[attr-defined]
        with open(self.out / f"{self.tag}.starts.rank{trainer.global_rank}", "a") as f:
            f.write(f"{trainer.global_step} {seen} {trainer.ckpt_path}\n")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save(local_weights(pl_module), self.out / f"{self.tag}.weights{trainer.global_rank}.pt")


@pytest.fixture(scope="module")
def example(ray_cluster):
    return importlib.import_module("ray_train")  # examples/ray_train.py, as the workers import it


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster (2 CPUs) for the module; its workers import the tests and examples/ray_train.py."""
    # Imported here, not at the top: collecting the fast tier does not pay for Ray. CI installs the `ray` extra
    # (scripts/setup.sh) and must run these.
    if os.environ.get("CI"):
        import ray
    else:
        ray = pytest.importorskip("ray", reason='needs the `ray` extra: pip install -e ".[ray]"')
    path = [str(REPO), str(REPO / "examples")]
    env = {
        "PYTHONPATH": os.pathsep.join(path),
        "PYTHONWARNINGS": "ignore",
        # Ray Train's controller polls the workers every 2 s by default: their reports are committed, and a dead
        # worker found, that much sooner.
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
        # One actor less per run (~2 CPU s each here): no node of this cluster is ever preempted.
        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    }
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(REPO / "examples"))
        yield
    ray.shutdown()


def _fit(example: Any, out: Path, tag: str, max_failures: int = 0, kill_at: int = 0) -> ray.train.Result:
    callbacks: list[L.Callback] = [_Record(out, tag)]
    if kill_at:
        callbacks.append(FailAt(rank=1, step=kill_at, how="kill", out_dir=out, once=True))
    return example.run(
        workers=2,
        max_failures=max_failures,
        storage_path=str(out / "ray_results"),
        name=tag,
        train_rows=STEPS_PER_EPOCH * 8 * 2,
        val_rows=VAL_ROWS,
        max_epochs=EPOCHS,
        report_every=EVERY,
        callbacks=callbacks,
    )


def _starts(out: Path, tag: str, rank: int) -> list[tuple[int, str, str]]:
    lines = (out / f"{tag}.starts.rank{rank}").read_text().splitlines()
    return [(int(m[1]), m[2], m[3]) for m in (re.fullmatch(r"(\d+) (\(.*\)) (.*)", line) for line in lines) if m]


def _weights(out: Path, tag: str) -> dict[str, torch.Tensor]:
    return assemble([torch.load(out / f"{tag}.weights{r}.pt") for r in range(2)])


@pytest.fixture(scope="module")
def uninterrupted(example, tmp_path_factory) -> tuple[Path, ray.train.Result]:
    out = tmp_path_factory.mktemp("ray_uninterrupted")
    return out, _fit(example, out, "uninterrupted")


def test_devices_auto_trains_on_two_workers_and_reports_sharded_directories(uninterrupted):
    out, result = uninterrupted
    assert result.error is None
    # Both workers trained from scratch on Ray's ranks: 2 of them, 2 on this node, each on the CPU.
    for rank in range(2):
        assert _starts(out, "uninterrupted", rank) == [(0, "(2, 2, 'cpu')", "None")]
    reported = sorted(int(metrics["step"]) for _, metrics in result.best_checkpoints)
    assert reported == list(range(EVERY, STEPS_PER_EPOCH * EPOCHS + 1, EVERY))
    # What Ray keeps is recshard's sharded directory, with each rank's shards, complete.
    kept = Path(result.checkpoint.path)
    assert is_checkpoint(kept), sorted(p.name for p in kept.iterdir())
    assert {re.match(r"__(\d+)_\d+\.distcp$", p.name)[1] for p in kept.glob("__*.distcp")} == {"0", "1"}
    assert _weights(out, "uninterrupted")


def test_a_killed_worker_resumes_from_the_last_reported_checkpoint(example, uninterrupted, tmp_path):
    reference_out, _ = uninterrupted
    result = _fit(example, tmp_path, "restarted", max_failures=1, kill_at=KILL_AT)
    assert result.error is None
    assert (tmp_path / "failed.rank1").exists(), "rank 1 was killed once"
    last_before_kill = max(range(EVERY, KILL_AT, EVERY))
    kept = {int(metrics["step"]): Path(checkpoint.path) for checkpoint, metrics in result.best_checkpoints}
    for rank in range(2):
        first, second = _starts(tmp_path, "restarted", rank)
        assert first == (0, "(2, 2, 'cpu')", "None")
        # Ray restarted the group from what it keeps of the last report before the kill.
        assert second == (last_before_kill, "(2, 2, 'cpu')", str(kept[last_before_kill]))
    got, want = _weights(tmp_path, "restarted"), _weights(reference_out, "uninterrupted")
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
