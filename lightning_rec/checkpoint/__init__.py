"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): each rank writes and reads only its own
shards, a checkpoint loads on any world size and plan, and loading checks everything before it changes anything.

What a checkpoint holds (see :mod:`~lightning_rec.checkpoint._layout` for the files):

* ``model/<fqn>``: the LightningModule's ``state_dict`` (sharded tables as ShardedTensors, dense weights once);
* ``optim/<i>/<fqn>/<state>``: every optimizer's state by parameter FQN, tables' under FBGEMM's names
  (:mod:`~lightning_rec.checkpoint._optimizer_state`), so it reshards like the tables;
* ``meta.pt``: Lightning's loops, callbacks, LR schedulers, epoch/step, optimizer param groups and the
  sharding plan, world size and embedding optimizer it was saved with (``checkpoint["lightning_rec"]``).

Use it through Lightning (``ModelCheckpoint``, ``trainer.save_checkpoint``, ``ckpt_path=``,
``MyModel.load_from_checkpoint(dir)`` for a :class:`~lightning_rec.RecLightningModule`; the strategy saves and loads
through :mod:`~lightning_rec.checkpoint._io`); :func:`is_checkpoint` tells a complete checkpoint directory,
:func:`export` turns one into a single-file, unsharded state dict, :func:`load_exported` reads that file back, and
:func:`load_module` turns a checkpoint into an unsharded LightningModule.

Example::

    from lightning_rec.checkpoint import export, is_checkpoint, load_exported
    assert is_checkpoint(path)
    export(path, "model.pt")
    state = load_exported("model.pt")
"""

from __future__ import annotations

from lightning_rec.checkpoint._export import export, load_exported, load_module
from lightning_rec.checkpoint._io import is_checkpoint
from lightning_rec.errors import CheckpointError, UnsafeCheckpointError

__all__ = [
    "CheckpointError",
    "UnsafeCheckpointError",
    "export",
    "is_checkpoint",
    "load_exported",
    "load_module",
]
