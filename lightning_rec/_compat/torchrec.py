"""TorchRec's private attributes and methods recshard relies on: the planner's state, the train pipeline's parts,
DMP's wrapped module, managed-collision parts, sharders' and tables' fused parameters, the fused kernels."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# TorchRec tags the per-call `nn.Parameter` views of fused (TBE) tables with this attribute: the optimizer
# living in the backward pass owns them, so a dense optimizer must never see them.
IN_BACKWARD_OPTIMIZER_ATTR = "_in_backward_optimizers"


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


# TorchRec: DMP keeps the module it wrapped for data parallelism (the dense part's DDP, or the module itself) in
# `_dmp_wrapped_module`; its public `module` property unwraps DDP, so the DDP itself has no public name.
def dmp_inner_module(dmp: object) -> object:
    """The module DMP wrapped (its dense part's DDP when there is one), or ``None``."""
    return getattr(dmp, "_dmp_wrapped_module", None)


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


# TorchRec: the backward of its reduce-scatter of unequal pieces (`comm_ops.ReduceScatterV_Wait.backward`) all-gathers
# the gradient's unequal pieces with `dist.all_gather`, which NCCL takes and gloo refuses. Its replacement (patched in
# through `patches.patch_class_attribute`, by strategy/uneven_batches.py) does what the original does, reading the
# request's private fields as it does, except that the unequal all-gather is `all_gather_v`'s; every other case (equal
# pieces, another backend) is the original's.
def reduce_scatter_v_backward(original: Any, all_gather_v: Any, replace: Any) -> Any:
    """A ``ReduceScatterV_Wait.backward`` that hands the unequal all-gather to ``all_gather_v(pieces, tensor, group)``
    (which returns an object with ``wait()``) wherever ``replace(group)`` says so, and calls ``original`` otherwise."""
    from torchrec.distributed.comm_ops import Request

    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        request: Request = ctx.myreq
        info = request.rsi
        if info.equal_splits or not replace(ctx.pg):
            return original(ctx, grad_output)
        if info.codecs is not None:
            grad_output = info.codecs.backward.encode(grad_output)
        grad_input = grad_output.new_empty(info.total_input_size)
        request.req = all_gather_v(list(grad_input.split(info.input_splits)), grad_output.contiguous(), ctx.pg)
        request.tensor = grad_input
        return (None, None, request.dummy_tensor)

    return backward
