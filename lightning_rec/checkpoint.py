"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

Layout of a checkpoint directory ``epoch=0-step=10.ckpt/``::

    .metadata               DCP's index of every tensor shard (written by rank 0 when all shards are in)
    __0_0.distcp, ...       each rank's own shards: table shards, fused optimizer state, dense tensors
    meta.pt                 Lightning's small, tensor-free part (loops, callbacks, schedulers, epoch), rank 0
    COMPLETE                written last, by rank 0, after every rank finished: a directory without it
                            is not a checkpoint

Every rank writes only what it owns; nothing is gathered.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer

META_FILE = "meta.pt"
COMPLETE_FILE = "COMPLETE"
_TENSOR_KEYS = ("state_dict", "optimizer_states")


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a complete lightning_rec checkpoint directory."""
    return path.is_dir() and (path / COMPLETE_FILE).is_file() and (path / META_FILE).is_file()


def save(checkpoint: Dict[str, Any], path: Path, *, is_global_zero: bool, barrier: Callable[[], None]) -> None:
    """Write Lightning's ``checkpoint`` dict to the directory ``path`` (every rank calls this).

    Tensors (model and optimizer state, sharded or not) go through DCP, each rank writing its own shards; the
    rest goes to ``meta.pt`` from rank 0; ``COMPLETE`` is written last.
    """
    if is_global_zero:
        if path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)  # overwriting: never leave a mix of old and new shards
        path.mkdir(parents=True)
    barrier()
    tensors = {
        "state_dict": checkpoint["state_dict"],
        "optimizer_states": {str(i): s for i, s in enumerate(checkpoint.get("optimizer_states", []))},
    }
    dcp.save(tensors, checkpoint_id=path)
    if is_global_zero:
        meta = {k: v for k, v in checkpoint.items() if k not in _TENSOR_KEYS}
        meta["num_optimizers"] = len(checkpoint.get("optimizer_states", []))
        torch.save(meta, path / META_FILE)
    barrier()
    if is_global_zero:
        (path / COMPLETE_FILE).write_text("ok\n")
    barrier()


def load(path: Path, module: nn.Module, optimizers: List[Optimizer]) -> Dict[str, Any]:
    """Load the checkpoint at ``path`` into ``module`` and ``optimizers`` in place (every rank calls this).

    Returns:
        Lightning's checkpoint dict (loops, callbacks, schedulers, ...), without tensors.
    """
    if not is_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a complete lightning_rec checkpoint (expected a directory with {META_FILE} and "
            f"{COMPLETE_FILE}). A save that crashed midway leaves no {COMPLETE_FILE}."
        )
    meta = torch.load(path / META_FILE, weights_only=False)
    model_sd = module.state_dict()
    target: Dict[str, Any] = {"state_dict": model_sd}
    if optimizers and meta.get("num_optimizers", 0):
        target["optimizer_states"] = {str(i): o.state_dict() for i, o in enumerate(optimizers)}
    dcp.load(target, checkpoint_id=path)
    module.load_state_dict(target["state_dict"])
    for i, opt in enumerate(optimizers):
        if "optimizer_states" in target:
            opt.load_state_dict(target["optimizer_states"][str(i)])
    return meta


def remove(path: Path) -> None:
    """Delete a checkpoint directory (or a plain file of the same name)."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


