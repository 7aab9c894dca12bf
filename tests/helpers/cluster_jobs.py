"""What the tests of real cluster jobs share (tests/strategy/test_slurm.py, tests/strategy/test_kubernetes.py): the
shipped synthetic DLRM config made small with a checkpoint every few steps, a user's shell environment, polling
with a deadline, and a checkpoint's weights."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_rec.checkpoint import export, load_exported
from lightning_rec.testing import shell_env
from tests.helpers.data import REPO

CONFIG = REPO / "examples" / "configs" / "synthetic_dlrm.yaml"


def small_run(steps: int, batch_size: int, every: int, world_size: int = 2) -> list[str]:
    """``lightning-rec fit`` arguments over the shipped config: one epoch of ``steps`` steps per rank, no validation,
    no progress bar, and a checkpoint every ``every`` steps (``epoch=0-step=<every>.ckpt`` tells that a job is
    mid-epoch; ``epoch=0-step=<steps>.ckpt`` holds the final weights)."""
    checkpoints = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"every_n_train_steps": every, "save_top_k": -1},
    }
    return [
        "--trainer.max_epochs=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.limit_val_batches=0",
        f"--data.init_args.train_rows={world_size * steps * batch_size}",
        f"--data.init_args.batch_size={batch_size}",
        "--data.init_args.val_rows=64",
        "--trainer.callbacks=" + json.dumps([checkpoints]),
    ]


def user_env() -> dict[str, str]:
    """A user's shell with the project's environment active: no rendezvous or SLURM variables of the test run,
    the virtual environment's commands (``lightning-rec``, ``torchrun``) first on the PATH."""
    env = {k: v for k, v in shell_env().items() if not k.startswith(("SLURM_", "PET_"))}
    bin_dir = str(Path(sys.executable).parent)
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "PYTHONWARNINGS": "ignore"}


def wait_for(what: str, ready: Callable[[], bool], timeout: float, log: Callable[[], str] = lambda: "") -> None:
    """Poll ``ready`` until it holds; after ``timeout`` seconds fail, naming ``what`` with the end of ``log()``."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f} s\n{log()[-4000:]}")
        time.sleep(0.1)  # polling the job's state and files, with the deadline above


def weights(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    """A sharded checkpoint's weights, unsharded (through :func:`lightning_rec.checkpoint.export`)."""
    export(checkpoint, out)
    return load_exported(out)


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
