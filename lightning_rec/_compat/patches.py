"""The one seam for patches of TorchRec's, FBGEMM's and Lightning's objects: the methods recshard replaces on single
instances, and the functions that do it (tests/test_compat.py pins each name to the installed versions)."""

from __future__ import annotations

import weakref
from typing import Any

# The methods recshard replaces on single instances of TorchRec's, FBGEMM's and Lightning's classes, and why (the one seam for
# such patches: `patch_method` below). A release that renames one fails `patch_method` at once, and the test pinned
# to the installed versions (tests/test_compat.py) names it.
PATCHED_METHODS = {
    # inputs/checks.py: the input checks at the door of every sharded module (its own forward and TorchRec's train
    # pipeline both call `module.input_dist`)
    "input_dist": ("torchrec.distributed.types", "ShardedModule"),
    # strategy/unsharded.py: the outputs put back in the unsharded key order (called by both forwards too)
    "compute_and_output_dist": ("torchrec.distributed.types", "ShardedModule"),
    # strategy/cpu_lookup.py: the faster CPU lookup of a fused table-batched embedding
    "forward": ("fbgemm_gpu.split_table_batched_embeddings_ops_training", "SplitTableBatchedEmbeddingBagsCodegen"),
    # strategy/preemption.py: Lightning's loop broadcasts a SIGTERM flag from rank 0 after every training batch (a
    # device tensor read back: one host sync per step on GPUs). Under recshard a signal is agreed on at the batch
    # boundary on the host instead (and Lightning's flag is never set), so the trainer's epoch loop skips it.
    "_broadcast_sigterm_tensor": ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop"),
    # strategy/quiet.py: Lightning's default progress bar prints each new bar's first line twice ("Training: 0/?" when
    # created and again when reset at the epoch's start; a log file or a notebook keeps both): the first reset of a
    # bar it creates is silent.
    "init_train_tqdm": ("lightning.pytorch.callbacks.progress.tqdm_progress", "TQDMProgressBar"),
    "init_validation_tqdm": ("lightning.pytorch.callbacks.progress.tqdm_progress", "TQDMProgressBar"),
    "reset": ("lightning.pytorch.callbacks.progress.tqdm_progress", "Tqdm"),
}


# Class attributes recshard replaces for the whole process, and why: a TorchRec autograd Function's static method, which
# runs for instances TorchRec creates lazily inside its sharded modules, and Lightning's checkpoint connector, which the
# Trainer creates and calls before any strategy hook (no instance patch reaches them). Each replacement delegates to the
# original wherever it does not change anything (`patch_class_attribute` below).
PATCHED_CLASS_ATTRIBUTES = {
    # strategy/uneven_batches.py: the backward of TorchRec's reduce-scatter of unequal pieces (row-wise, table-row-wise
    # and grid shardings when the ranks' batch sizes differ) all-gathers unequal pieces, which gloo refuses; over gloo
    # it all-gathers them padded to equal sizes instead.
    "ReduceScatterV_Wait.backward": "torchrec.distributed.comm_ops",
    # strategy/checkpoint_dirs.py (through `lightning.route_last_checkpoint`): Lightning resolves `ckpt_path="last"`,
    # and a SLURM job's requeue start, in its checkpoint connector before any strategy hook runs, to any run's newest
    # checkpoint, complete or not; a strategy that resolves them itself (recshard) takes this run's newest complete one.
    "_CheckpointConnector._parse_ckpt_path": "lightning.pytorch.trainer.connectors.checkpoint_connector",
    "_CheckpointConnector._hpc_resume_path": "lightning.pytorch.trainer.connectors.checkpoint_connector",
}

# What each patched class attribute was before recshard replaced it.
_CLASS_ORIGINALS: dict[str, object] = {}


def _attribute_owner(key: str) -> tuple[type, str]:
    import importlib

    if key not in PATCHED_CLASS_ATTRIBUTES:
        raise KeyError(f"lightning_rec._compat does not patch {key!r} (PATCHED_CLASS_ATTRIBUTES names what it patches)")
    cls_name, attr = key.split(".")
    cls = getattr(importlib.import_module(PATCHED_CLASS_ATTRIBUTES[key]), cls_name)
    if attr not in vars(cls):
        raise AttributeError(
            f"{cls.__name__} has no attribute {attr!r} of its own: lightning_rec._compat must follow it"
        )
    return cls, attr


def patch_class_attribute(key: str, make_replacement: Any) -> None:
    """Replace the class attribute ``key`` (``"Class.attribute"``, named in :data:`PATCHED_CLASS_ATTRIBUTES`) with
    ``make_replacement(original)``, once per process (later calls do nothing): the replacement receives the original
    (a plain function for a static method) to delegate to."""
    if key in _CLASS_ORIGINALS:
        return
    cls, attr = _attribute_owner(key)
    original = vars(cls)[attr]
    function = original.__func__ if isinstance(original, staticmethod) else original
    replacement = make_replacement(function)
    _CLASS_ORIGINALS[key] = original
    setattr(cls, attr, staticmethod(replacement) if isinstance(original, staticmethod) else replacement)


def unpatch_class_attribute(key: str) -> None:
    """Put back what ``key`` was before :func:`patch_class_attribute` (nothing to do if it was not patched)."""
    if key not in _CLASS_ORIGINALS:
        return
    cls, attr = _attribute_owner(key)
    setattr(cls, attr, _CLASS_ORIGINALS.pop(key))


def is_class_attribute_patched(key: str) -> bool:
    """Whether recshard replaced the class attribute ``key``."""
    return key in _CLASS_ORIGINALS


def _patched_class(name: str) -> type:
    import importlib

    if name not in PATCHED_METHODS:
        raise KeyError(f"lightning_rec._compat does not patch {name!r} (PATCHED_METHODS names what it patches)")
    module, cls = PATCHED_METHODS[name]
    return getattr(importlib.import_module(module), cls)


# What each patched instance had before recshard's first patch of a name (None: its class's method).
_ORIGINALS: weakref.WeakKeyDictionary[object, dict[str, object]] = weakref.WeakKeyDictionary()


def patchable(obj: object, name: str) -> bool:
    """Whether ``obj`` is of the class :data:`PATCHED_METHODS` names for ``name`` (e.g. a module the plan sharded)."""
    return isinstance(obj, _patched_class(name))


def patch_method(obj: object, name: str, replacement: object) -> None:
    """Make ``obj.<name>(...)`` call ``replacement`` (an instance attribute shadows the class's method, which
    ``nn.Module.__call__`` and every caller look up); ``obj`` must be an instance of the class
    :data:`PATCHED_METHODS` names for ``name``, and that class must still have the method. Patching again replaces
    recshard's earlier patch; :func:`unpatch_method` restores what was there before the first."""
    cls = _patched_class(name)
    if not isinstance(obj, cls):
        raise TypeError(f"patch_method({name!r}) patches {cls.__name__} instances, got {type(obj).__name__}")
    if not callable(getattr(type(obj), name, None)):
        raise AttributeError(f"{type(obj).__name__} has no method {name!r}: lightning_rec._compat must follow it")
    originals = _ORIGINALS.setdefault(obj, {})
    if name not in originals:
        originals[name] = vars(obj).get(name)
    object.__setattr__(obj, name, replacement)


def unpatch_method(obj: object, name: str) -> None:
    """Give ``obj`` back what its ``name`` was before recshard patched it (nothing to do if it did not)."""
    _patched_class(name)
    originals = _ORIGINALS.get(obj, {})
    if name not in originals:
        return
    before = originals.pop(name)
    if before is None:
        vars(obj).pop(name, None)
    else:
        object.__setattr__(obj, name, before)


def original_method(obj: object, name: str) -> Any:
    """What ``obj.<name>`` was before recshard patched it: its class's method (bound), or an instance attribute
    something else had set."""
    _patched_class(name)
    originals = _ORIGINALS.get(obj, {})
    before = originals[name] if name in originals else vars(obj).get(name)
    return before if before is not None else getattr(type(obj), name).__get__(obj, type(obj))


def is_patched(obj: object, name: str) -> bool:
    """Whether recshard replaced ``obj``'s ``name``."""
    return name in _ORIGINALS.get(obj, {})
