"""The only home of private imports and version gates.

Lightning keeps several helpers that every strategy needs (process-group start-up, collective reductions,
the script launcher, optimizer construction from ``configure_optimizers``) behind underscore names. They are
imported here, once, so that a Lightning upgrade that moves them breaks one file with an obvious fix.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

# Lightning: process-group helpers shared by its own DDP/FSDP/ModelParallel strategies. There is no public
# equivalent; re-implementing them would fork Lightning's handling of cluster environments and timeouts.
# Lightning: `torch.set_num_threads(cpus // processes)` + OMP_NUM_THREADS unless the user set OMP_NUM_THREADS. Its
# launcher calls it in the launching process only, after starting the other ranks, so they keep one intra-op
# thread per core each: on 2 cores, rank 1's idle OpenMP threads spun for 44 of its 47 CPU seconds in a 2-process
# job (BENCHMARKS.md). The strategy calls it on every rank.
from lightning.fabric.utilities.distributed import (  # noqa: F401
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,  # noqa: F401
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group  # noqa: F401

# Lightning's fork launcher (`ddp_notebook`'s), what an interactive session can start ranks with, and whether this
# is one (Lightning's own test, which refuses any other launcher there).
from lightning.fabric.utilities.imports import _IS_INTERACTIVE as IS_INTERACTIVE  # noqa: F401
from lightning.fabric.utilities.seed import reset_seed  # noqa: F401

# Lightning: turns `configure_optimizers()` output into optimizers + LRSchedulerConfigs (all return forms,
# validation included). The strategy must call it itself because the embedding optimizer has to be known
# before the tables are sharded.
# Lightning: what `configure_optimizers` may return (an optimizer, a list, a dict with a scheduler, ...) to the list of
# optimizers; `lightning-rec plan` calls `configure_optimizers` without a Trainer, so not through the hook above.
from lightning.pytorch.core.optimizer import (
    _configure_optimizers,
    _init_optimizers_and_lr_schedulers,  # noqa: F401
)

# Lightning's accelerator connector hands string strategies to this registry.
from lightning.pytorch.strategies import StrategyRegistry  # noqa: F401
from lightning.pytorch.strategies.launchers.multiprocessing import (  # noqa: F401
    _MultiProcessingLauncher,
    _WorkerOutput,
)

# Lightning: the `popen` launcher that re-runs the user's script once per local rank (what `ddp` uses).
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher  # noqa: F401

# Lightning: reroutes `training_step` through the wrapper's forward (so DDP sees it); its hooks let a strategy
# stop DDP's reducer during a manual-optimization forward, as Lightning's own DDPStrategy does.
from lightning.pytorch.strategies.strategy import _ForwardRedirection  # noqa: F401

# torch: sharded tables' weights and fused-optimizer state are ShardedTensors, a type torch still keeps under a
# private path (TorchRec imports it from there too); checkpointing has to recognise them.
from torch.distributed._shard.sharded_tensor import ShardedTensor  # noqa: F401

# torch: the dispatch-mode base class (what sees every aten op, e.g. to count host syncs in
# lightning_rec.testing) lives only under a private module path; torch's own docs import it from there.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

if TYPE_CHECKING:
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.loops.evaluation_loop import _EvaluationLoop
    from lightning.pytorch.loops.prediction_loop import _PredictionLoop
    from torch.optim import Optimizer

# TorchRec tags the per-call `nn.Parameter` views of fused (TBE) tables with this attribute: the optimizer
# living in the backward pass owns them, so a dense optimizer must never see them.
IN_BACKWARD_OPTIMIZER_ATTR = "_in_backward_optimizers"


def parse_optimizers(optim_conf: Any) -> list:
    """The optimizers in what ``LightningModule.configure_optimizers`` returned (``None``: none)."""
    return [] if optim_conf is None else list(_configure_optimizers(optim_conf)[0])


def planner_sharding_options(planner: object) -> list | None:
    """The ``ShardingOption``s the TorchRec planner chose in its last ``plan()``, with per-shard storage and perf
    estimates, or ``None``. TorchRec keeps them only in the private ``_best_plan`` (its stats printer reads
    them there); the returned ``ShardingPlan`` drops the estimates, and the plan report needs them."""
    return getattr(planner, "_best_plan", None)


# TorchRec: the planner keeps the topology, constraints and batch size it was built with in private attributes; an
# enumerator built from the same three proposes the options it chose from (lightning-rec plan's "does not fit").
# (`planner: Any`: TorchRec ships no type information, so its objects are Any to the type checker anyway.)
def planner_topology(planner: Any) -> Any:
    """The ``Topology`` an ``EmbeddingShardingPlanner`` plans for."""
    return planner._topology


def planner_constraints(planner: Any) -> Any:
    """The ``ParameterConstraints`` by table name an ``EmbeddingShardingPlanner`` was given."""
    return planner._constraints


def planner_batch_size(planner: Any) -> int:
    """The per-rank batch size an ``EmbeddingShardingPlanner`` costs with."""
    return planner._batch_size


def create_topology(
    *,
    world_size: int,
    local_world_size: int,
    device_type: str,
    hbm_cap: int | None,
    ddr_cap: int | None,
    hardware: dict[str, Any] | None,
) -> Any:
    """TorchRec's planner ``Topology``: through ``TopologyFactory`` where TorchRec has it (1.8 warns about any other
    way), else (TorchRec 1.6, the GPU machine's) built directly from the same numbers.

    Args:
        hardware: ``HardwareConfig`` arguments (memory in bytes, bandwidths in bytes/ms); ``None``: TorchRec's
            defaults. The caps ``hbm_cap``/``ddr_cap`` win over the hardware's.
    """
    try:
        from torchrec.distributed.planner.types import HardwareConfig, KernelConfig, TopologyFactory, TrainerConfig
    except ImportError:  # TorchRec < 1.7
        from torchrec.distributed.planner.types import Topology

        hw = {k: v for k, v in (hardware or {}).items() if v is not None}
        return Topology(
            world_size=world_size,
            compute_device=device_type,
            local_world_size=local_world_size,
            hbm_cap=hbm_cap if hbm_cap is not None else hw.pop("hbm_cap_bytes", None),
            ddr_cap=ddr_cap if ddr_cap is not None else hw.pop("ddr_cap_bytes", None),
            **{k: v for k, v in hw.items() if not k.endswith("_cap_bytes")},
        )
    return TopologyFactory.create_topology(
        TrainerConfig(
            world_size=world_size, local_world_size=local_world_size, hbm_cap_bytes=hbm_cap, ddr_cap_bytes=ddr_cap
        ),
        hardware_config=HardwareConfig(**hardware) if hardware is not None else None,
        kernel_config=KernelConfig(compute_device=device_type, use_hardware_based_bandwidth=hardware is not None),
    )


# TorchRec: the enumerator intersects a table's constrained sharding types with its sharder's as Python sets, so their
# order (and which of two equally costed types wins a tie, e.g. row_wise and table_row_wise on one host) follows the
# process's string hash seed: `lightning-rec plan` and the fit's rank 0 chose different plans for the same model.
# The enumerator below keeps the sharder's order, so the same inputs give the same plan in every process.
def ordered_enumerator(topology: Any, batch_size: int, constraints: Any) -> Any:
    """TorchRec's ``EmbeddingEnumerator`` (as the planner builds it by default) with the sharding types of each
    table in its sharder's order."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    class OrderedEnumerator(EmbeddingEnumerator):
        def _filter_sharding_types(self, name: str, allowed: list[str], *args: Any, **kwargs: Any) -> list[str]:
            kept = super()._filter_sharding_types(name, allowed, *args, **kwargs)
            rank = {t: i for i, t in enumerate(allowed)}
            return sorted(kept, key=lambda t: rank.get(t, len(rank)))

    return OrderedEnumerator(topology=topology, batch_size=batch_size, constraints=constraints)


# TorchRec: `TrainPipelineSparseDist.progress()` runs forward, backward and the optimizer itself. To keep
# Lightning's step, lightning_rec._strategy.pipeline drives the pipeline's parts from Lightning's hooks; three of the parts
# it needs have no public name in TorchRec 1.8 (its own `progress()` calls them). (`pipeline: Any`: TorchRec's
# `TrainPipelineSparseDist`, untyped.)
def pipeline_rewrite(pipeline: Any) -> None:
    """Rewrite the sharded modules' forwards to read pre-distributed inputs, and start the head batch's input
    distribution (first time, or again after ``detach()``)."""
    if pipeline._pipelined_modules:
        pipeline.attach()  # re-rewrites with batches[0]
    else:
        pipeline._init_pipelined_modules(
            pipeline.batches[0],
            pipeline.contexts[0],
            pipeline._pipelined_forward_type,
        )


def pipeline_set_context(pipeline: Any, context: object) -> None:
    """Point the pipelined forwards at ``context`` (the batch about to run)."""
    pipeline._set_module_context(context)


def pipeline_wait_for_batch(pipeline: Any) -> None:
    """Make the compute stream wait for the head batch's host-to-device copy."""
    pipeline._wait_for_batch()


def default_store() -> torch.distributed.Store | None:
    """The default process group's key-value store, or ``None`` without a process group. torch keeps it private
    (``_get_default_store``); :mod:`lightning_rec._strategy.faults` uses it so that a failing rank can tell the others why,
    without opening a second rendezvous."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def tensor_version(tensor: torch.Tensor) -> int:
    """How many times ``tensor`` (or a view of its storage) was changed in place: torch's autograd version counter,
    public in behaviour but underscore-named (``Tensor._version``). The input checks use it to notice a checked
    KJT changed in place inside ``forward``. An inference tensor (made under ``torch.inference_mode``, e.g. the batch
    ``trainer.predict`` copies to a GPU) keeps no counter: -2, which no recorded version equals."""
    return -2 if tensor.is_inference() else tensor._version


# Lightning: what `move_data_to_device` moves (anything with a `.to`); the strategy moves batches itself so that
# TorchRec's batches and KJTs are copied without blocking (Lightning passes non_blocking to plain tensors only).
from lightning.fabric.utilities.apply_func import _TransferableDataType  # noqa: E402, F401


def call_batch_hook(module: LightningModule, name: str, *args: object) -> object:
    """Run the LightningModule's (or the datamodule's) batch hook ``name`` the way Lightning does (its private
    ``_call_batch_hook``: the datamodule's override wins, with Lightning's profiling)."""
    return module._call_batch_hook(name, *args)


# TorchRec: DMP keeps the module it wrapped for data parallelism (the dense part's DDP, or the module itself) in
# `_dmp_wrapped_module`; its public `module` property unwraps DDP, so the DDP itself has no public name.
def dmp_inner_module(dmp: object) -> object:
    """The module DMP wrapped (its dense part's DDP when there is one), or ``None``."""
    return getattr(dmp, "_dmp_wrapped_module", None)


# Lightning: where its loops stand (the batch index in the training epoch, the validation loop fit runs, how many
# batches a loop has fetched). The loops' progress trackers are not a documented API; error messages use them to
# name the step and batch a failure happened at.
def training_batch_idx(trainer: Trainer) -> int:
    return trainer.fit_loop.epoch_loop.batch_idx


def fit_validation_loop(trainer: Trainer) -> _EvaluationLoop:
    return trainer.fit_loop.epoch_loop.val_loop


def batches_fetched(loop: _EvaluationLoop | _PredictionLoop) -> int:
    return loop.batch_progress.current.ready


# Lightning: a LightningModule's trainer, or None when it is not attached (the public `trainer` property raises then).
def attached_trainer(module: object) -> object | None:
    return getattr(module, "_trainer", None)


# Lightning: the optimizer inside a LightningOptimizer (or the optimizer itself).
def unwrap_optimizer(optimizer: Optimizer | LightningOptimizer) -> Optimizer:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


# TorchRec: a managed-collision module (`ManagedCollisionEmbeddingBagCollection`/`...EmbeddingCollection`) keeps its
# embedding collection and its `ManagedCollisionCollection` in underscore attributes, with no public accessor (the
# feature-processed module has `split()`); the table configs, input checks and serving need both.
def managed_collision_parts(module: object) -> tuple:
    """``(embedding collection, ManagedCollisionCollection, {table: its ManagedCollisionModule})`` of a
    managed-collision embedding module."""
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    if not isinstance(module, BaseManagedCollisionEmbeddingCollection):
        raise TypeError(f"expected a managed-collision embedding module, got {type(module).__name__}")
    collection = module._managed_collision_collection
    return module._embedding_module, collection, dict(collection._managed_collision_modules.items())


# TorchRec: a managed-collision module keeps the row segments of the layout it was built for in its
# `_output_segments_tensor` buffer, and no other copy (its `_init_output_segments_tensor` is the same tensor), so a
# checkpoint load writes the saving job's segments over them; `validate_state()`, TorchRec's post-load step, then
# checks the module's rows against them. A load that moved the slots onto this job's layout puts its segments back.
def collision_output_segments(module: object) -> torch.Tensor:
    """The row segments buffer of a ``ManagedCollisionModule``."""
    from torchrec.modules.mc_modules import ManagedCollisionModule

    if not isinstance(module, ManagedCollisionModule):
        raise TypeError(f"expected a ManagedCollisionModule, got {type(module).__name__}")
    buffers = dict(module.named_buffers(recurse=False))
    if "_output_segments_tensor" not in buffers:
        raise AttributeError(
            f"{type(module).__name__} has no buffer '_output_segments_tensor': this TorchRec version keeps it "
            "elsewhere (lightning_rec._compat must follow it)."
        )
    return buffers["_output_segments_tensor"]


# TorchRec: an embedding sharder keeps its FBGEMM arguments in `_fused_params` (a feature-processed or
# managed-collision sharder in the EBC/EC sharder it holds as `_ebc_sharder`/`_e_sharder`), read-only through the
# `fused_params` property. The strategy must pass the fused optimizer derived from `configure_optimizers` into a
# sharder the user passed in (TorchRec has no setter, and rebuilding the user's sharder would lose its other options).
def _fused_params_holder(sharder: object) -> object | None:
    from torchrec.distributed.embedding_types import BaseEmbeddingSharder
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embedding_modules import BaseManagedCollisionEmbeddingCollectionSharder

    if isinstance(sharder, FeatureProcessedEmbeddingBagCollectionSharder):
        return _fused_params_holder(_private(sharder, "_ebc_sharder"))
    if isinstance(sharder, BaseManagedCollisionEmbeddingCollectionSharder):
        return _fused_params_holder(_private(sharder, "_e_sharder"))
    return sharder if isinstance(sharder, BaseEmbeddingSharder) else None


def _private(obj: object, name: str) -> Any:
    if name not in vars(obj):
        raise AttributeError(
            f"{type(obj).__name__} has no attribute {name!r}: this TorchRec version keeps it elsewhere "
            "(lightning_rec._compat must follow it)."
        )
    return vars(obj)[name]


def _set_private(obj: object, name: str, value: object) -> None:
    """``obj.<name> = value`` for an attribute the other package's class does not declare (TorchRec's ad-hoc
    attributes on sharders and table weights)."""
    setattr(obj, name, value)


def sharder_fused_params(sharder: object) -> dict | None:
    """The ``fused_params`` an embedding sharder sets (``{}`` for none), or ``None`` for another kind of sharder."""
    holder = _fused_params_holder(sharder)
    return None if holder is None else dict(_private(holder, "_fused_params") or {})


def with_sharder_fused_params(sharder: object, fused_params: dict, classes: dict[type, type] | None = None) -> object:
    """A copy of an embedding sharder whose tables get ``fused_params`` (the sharder itself is left as it was).

    ``classes``: a copy (or the copy of a sharder it holds) whose type is a key becomes an instance of the value, a
    subclass that adds no state (e.g. TorchRec's EBC sharder -> one that also offers row-wise on CPU)."""
    import copy

    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embedding_modules import BaseManagedCollisionEmbeddingCollectionSharder

    out = copy.copy(sharder)
    upgrade = (classes or {}).get(type(sharder))
    if upgrade is not None:
        out.__class__ = upgrade
    if isinstance(sharder, FeatureProcessedEmbeddingBagCollectionSharder):
        inner = with_sharder_fused_params(_private(sharder, "_ebc_sharder"), fused_params, classes)
        _set_private(out, "_ebc_sharder", inner)
    elif isinstance(sharder, BaseManagedCollisionEmbeddingCollectionSharder):
        _set_private(
            out, "_e_sharder", with_sharder_fused_params(_private(sharder, "_e_sharder"), fused_params, classes)
        )
    else:
        _private(sharder, "_fused_params")
        _set_private(out, "_fused_params", dict(fused_params))
    return out


# TorchRec: a table's own fused parameters (another optimizer or learning rate than its sharder's) are read from its
# unsharded weight's `_optimizer_classes`/`_optimizer_kwargs` when the module is sharded (embeddingbag.py and
# embedding.py, `create_sharding_infos_by_sharding`), which `torchrec.optim.apply_optimizer_in_backward` sets. That
# function also hooks an optimizer into the weight's backward; the unsharded weight never runs a backward here, so the
# strategy sets the two attributes alone, for the time of sharding.
_TABLE_OPTIMIZER_ATTRS = ("_optimizer_classes", "_optimizer_kwargs")


def in_backward_optimizer(weight: object) -> tuple | None:
    """``(optimizer class, kwargs)`` that ``torchrec.optim.apply_optimizer_in_backward`` gave this table weight, or
    ``None``."""
    classes, kwargs = vars(weight).get("_optimizer_classes"), vars(weight).get("_optimizer_kwargs")
    if not classes or classes[0] is None or not kwargs:
        return None
    return classes[0], dict(kwargs[0])


@contextlib.contextmanager
def optimizer_state_for_planner(weights: Mapping[torch.Tensor, object]) -> Iterator[None]:
    """Within this block, each unsharded table weight (key) tells TorchRec's planner the optimizer class (value) whose
    state its storage estimate adds; a weight that names a class already (``apply_optimizer_in_backward``) keeps it.

    TorchRec's ``EmbeddingStorageEstimator`` reads the optimizer only from the private ``_optimizer_classes`` of each
    table's weight (what ``apply_optimizer_in_backward`` sets), never from the sharders' ``fused_params``: without this
    a table trained by a fused Adam was planned with a third of its memory. The sharders read the attribute too, so
    it is set for planning only and restored before anything is sharded."""
    saved = {id(w): (w, w.__dict__.get("_optimizer_classes")) for w in weights}
    try:
        for weight, cls in weights.items():
            classes = getattr(weight, "_optimizer_classes", None)
            if not classes or classes[0] is None:
                _set_private(weight, "_optimizer_classes", [cls])
        yield
    finally:
        for weight, before in saved.values():
            weight.__dict__.pop("_optimizer_classes", None)
            if before is not None:
                _set_private(weight, "_optimizer_classes", before)


@contextlib.contextmanager
def table_fused_params(weights: Mapping[torch.Tensor, Mapping[str, Any]]) -> Iterator[None]:
    """Within this block, each unsharded table weight (key) carries its own fused parameters (value) for TorchRec's
    sharders; restored afterwards."""
    saved = {id(w): (w, {a: w.__dict__[a] for a in _TABLE_OPTIMIZER_ATTRS if a in w.__dict__}) for w in weights}
    try:
        for weight, fused in weights.items():
            _set_private(weight, "_optimizer_classes", [None])
            _set_private(weight, "_optimizer_kwargs", [dict(fused)])
        yield
    finally:
        for weight, before in saved.values():
            for attr in _TABLE_OPTIMIZER_ATTRS:
                weight.__dict__.pop(attr, None)
            weight.__dict__.update(before)


# TorchRec: a sharded embedding module keeps its lookups (one per sharding type) in the plain list `_lookups` (not a
# ModuleList, so `modules()` does not reach them), each holding its kernels in the ModuleList `_emb_modules`; a fused
# kernel (`BatchedFusedEmbeddingBag`) exposes its FBGEMM TBE as `emb_module`. The faster CPU lookup
# (lightning_rec._strategy.cpu_lookup) has to reach every TBE, and TorchRec offers no accessor.
def fused_tbes(model: object) -> Iterator[tuple]:
    """``(where, FBGEMM TBE)`` of every fused pooled-embedding kernel in ``model``'s sharded modules, each once (a
    feature-processed module and the collection inside it share their lookups); ``where`` is
    ``"<module path>/<lookup>.<kernel>"``."""
    from torch import nn
    from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbeddingBag
    from torchrec.distributed.embedding_types import ShardedEmbeddingModule

    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    seen: set[int] = set()
    for path, module in model.named_modules():
        if not isinstance(module, ShardedEmbeddingModule):
            continue
        lookups = _private(module, "_lookups")
        if not isinstance(lookups, (list, nn.ModuleList)):
            raise TypeError(f"{type(module).__name__}._lookups is a {type(lookups).__name__}, expected a list")
        for i, lookup in enumerate(lookups):
            for j, kernel in enumerate(k for k in lookup.modules() if isinstance(k, BatchedFusedEmbeddingBag)):
                if id(kernel.emb_module) not in seen:
                    seen.add(id(kernel.emb_module))
                    yield f"{path or '<root>'}/{i}.{j}", kernel.emb_module


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
}


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


# torch: what `Tensor.to(*args, **kwargs)` was asked for (device, dtype, non_blocking, memory_format), parsed as torch
# parses it; the one parser of every `to` signature (device, dtype, other tensor, keywords) is private.
def parse_to(*args: Any, **kwargs: Any) -> tuple:
    """``(device, dtype, non_blocking, memory_format)`` of a ``Tensor.to`` call's arguments."""
    import torch

    return torch._C._nn._parse_to(*args, **kwargs)


# Lightning: the name of the next "hpc" checkpoint in a folder (``hpc_ckpt_<n+1>.ckpt``), the one its SLURM requeue
# resumes from (``_CheckpointConnector._hpc_resume_path``); the preemption save uses the same name so that a requeued
# job finds it the way Lightning's own requeue does. Only the private connector computes it.
def hpc_save_path(folder: Any) -> str:
    """Where Lightning's next "hpc" checkpoint in ``folder`` goes."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    return _CheckpointConnector.hpc_save_path(folder)


# Lightning: ``ckpt_path="last"`` is turned into a path by ``_CheckpointConnector._parse_ckpt_path`` in
# ``Trainer.fit/validate/...`` before any strategy hook runs, and it looks only in the new run's own ``version_N``
# folder (and nowhere for the "hpc" checkpoints a preempted job saves): a restarted job (torchrun --max-restarts, an
# operator re-running the command) starts over, silently. A strategy with ``resolve_last_checkpoint(trainer)`` answers
# "last" itself; this wraps the connector's method once (class-level: there is no hook before it), and changes nothing
# for other strategies or other values of ``ckpt_path``.
def route_last_checkpoint() -> None:
    """Let the trainer's strategy resolve ``ckpt_path="last"`` (idempotent)."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    original = _CheckpointConnector._parse_ckpt_path
    if getattr(original, "__lightning_rec__", False):
        return

    def _parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        resolve = getattr(self.trainer.strategy, "resolve_last_checkpoint", None)
        if ckpt_path == "last" and resolve is not None:
            found = resolve(self.trainer)
            if found is not None:
                return found
        return original(self, state_fn, ckpt_path, model_provided, model_connected)

    _parse_ckpt_path.__lightning_rec__ = True  # type: ignore[attr-defined]
    _parse_ckpt_path.__wrapped__ = original  # type: ignore[attr-defined]
    _CheckpointConnector._parse_ckpt_path = _parse_ckpt_path  # type: ignore[method-assign]


def cpp_compiler() -> str | Exception:
    """The C++ compiler AOTInductor will call, or why there is none (its own search: ``CXX``, then ``g++``)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return get_cpp_compiler()
    except Exception as err:  # InvalidCxxCompiler, or a failed probe of the compiler
        return err


def interpreter_exit() -> None:
    """What the interpreter runs as it ends, for a process that will leave with ``os._exit`` (a multiprocessing
    child, e.g. a test rank forked from :mod:`lightning_rec._forkserver`): ``threading._shutdown`` (the hooks that
    stop executor threads, then non-daemon threads joined), then the ``atexit`` handlers."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
