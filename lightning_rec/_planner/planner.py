"""From tables, topology and per-table constraints to a TorchRec ``ShardingPlan``, and the sharders that carry it out.

The planner itself is TorchRec's ``EmbeddingShardingPlanner``; this module turns typed, YAML-friendly
configuration into its inputs (the resulting plan as a table people can read is
:mod:`lightning_rec._strategy.plan_report`). It also holds the sharders of every TorchRec embedding module that
trains (:func:`make_sharders`: EBC and EC, position-weighted and managed-collision ones, with the fused optimizer and
quantized comms passed into each, a user's too).

What TorchRec can run on each device, and the refusals that name what cannot, checked before any distributed work,
are in :mod:`lightning_rec._strategy.device_support`.

Example::

    planner = make_planner(world_size=2, device_type="cpu", topology=None, constraints={})
    sharders = make_sharders(EmbeddingOptimizer("adagrad", lr=0.1).to_fused_params())
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import get_qcomm_codecs_registry
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from lightning_rec import _compat
from lightning_rec._strategy.device_support import default_constraints, kernels_on
from lightning_rec._strategy.topology import DevicePreset, make_topology
from lightning_rec._tables import embedding_tables
from lightning_rec.config import QuantizedComms, TableConstraints, TopologyConfig

# The fused_params keys that describe the embedding optimizer (EmbeddingOptimizer.to_fused_params writes them).
_OPTIMIZER_KEYS = ("optimizer", "learning_rate", "eps", "beta1", "beta2", "weight_decay", "weight_decay_mode")


class EBCSharder(EmbeddingBagCollectionSharder):
    """TorchRec's ``EmbeddingBagCollectionSharder``, offering ``row_wise``, ``table_row_wise`` and ``grid_shard`` on
    CPU too (TorchRec lists them for CUDA only; over gloo they train exactly like the unsharded module).

    Example::

        sharder = EBCSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
        "row_wise" in sharder.sharding_types("cpu")   # True
    """

    def sharding_types(self, compute_device_type: str) -> list[str]:  # noqa: D102
        return super().sharding_types("cuda" if compute_device_type == "cpu" else compute_device_type)


class MCEBCSharder(ManagedCollisionEmbeddingBagCollectionSharder):
    """TorchRec's ``ManagedCollisionEmbeddingBagCollectionSharder`` (row-wise tables, the raw id space split across
    ranks with them), with the fused kernel on CPU; its tables go through ``ebc_sharder`` (default
    :class:`EBCSharder`, which admits row-wise on CPU)."""

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:  # noqa: D102
        return kernels_on(super().compute_kernels(sharding_type, compute_device_type), compute_device_type)


class MCECSharder(ManagedCollisionEmbeddingCollectionSharder):
    """TorchRec's ``ManagedCollisionEmbeddingCollectionSharder``, as :class:`MCEBCSharder` for unpooled tables."""

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:  # noqa: D102
        return kernels_on(super().compute_kernels(sharding_type, compute_device_type), compute_device_type)


def qcomms_registry(qcomms: QuantizedComms | None) -> dict[str, Any] | None:
    """TorchRec's codec registry for ``qcomms`` (``None``: full precision)."""
    if qcomms is None:
        return None
    # No device: TorchRec then keeps bf16 as asked. Given the CPU device it replaces bf16 by fp16 ("not supported on
    # GLOO"), yet gloo carries bfloat16 all-to-alls with this torch (tests/strategy/test_torchrec_models.py).
    return get_qcomm_codecs_registry(qcomms.to_torchrec())


def make_planner(
    *,
    world_size: int,
    device_type: str,
    topology: TopologyConfig | None,
    constraints: Mapping[str, TableConstraints],
    local_world_size: int | None = None,
    preset: DevicePreset | None = None,
    batch_size: int | None = None,
) -> EmbeddingShardingPlanner:
    """TorchRec's planner for this job: its topology (``world_size`` ranks, ``local_world_size`` of them per host,
    the memory and bandwidths of ``preset``, with ``topology`` overrides) and constraints.

    Args:
        local_world_size: ranks per host, as the launcher started them (the strategy passes its devices per
            node); ``topology.local_world_size`` overrides it; default: all ranks on one host.
        preset: the devices' memory and bandwidths (default: see :func:`~lightning_rec._strategy.topology.default_preset`).
        batch_size: per-rank batch size of the cost model (default: ``topology.batch_size``, else TorchRec's 512).
    """
    topo = topology or TopologyConfig()
    planner_topology = make_topology(
        world_size=world_size,
        local_world_size=topo.ranks_per_host(local_world_size or world_size),
        device_type=device_type,
        topology=topo,
        preset=preset,
    )
    batch = batch_size or topo.batch_size or BATCH_SIZE
    torchrec_constraints = {name: c.to_torchrec() for name, c in constraints.items()}
    return EmbeddingShardingPlanner(
        topology=planner_topology,
        batch_size=batch,
        enumerator=_compat.ordered_enumerator(planner_topology, batch, torchrec_constraints),
        # TorchRec's recommended reservation (its heuristic default warns that it over-estimates dense size).
        storage_reservation=FixedPercentageStorageReservation(percentage=0.15),
        constraints=torchrec_constraints,
        debug=False,
    )


def table_storage_options(
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    planner: EmbeddingShardingPlanner,
) -> dict[str, list[Any]]:
    """Every sharding option TorchRec's enumerator proposes for each table of ``module`` under ``planner``'s
    topology, constraints and batch size, with each shard's storage estimated (what the planner packs onto ranks),
    by table name. For explaining why a model does not fit."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator

    topology, constraints = _compat.planner_topology(planner), _compat.planner_constraints(planner)
    enumerator = EmbeddingEnumerator(
        topology=topology,
        batch_size=_compat.planner_batch_size(planner),
        constraints=constraints,
        estimator=EmbeddingStorageEstimator(topology=topology, constraints=constraints),
    )
    options: dict[str, list[Any]] = {}
    for option in enumerator.enumerate(module, sharders):
        options.setdefault(option.name, []).append(option)
    return options


def plan_sharding(
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    planner: EmbeddingShardingPlanner,
    pg: dist.ProcessGroup | None,
) -> ShardingPlan:
    """Plan on rank 0 and broadcast the result, so every rank shards identically."""
    if pg is not None and dist.is_initialized():
        return planner.collective_plan(module, sharders, pg)
    return planner.plan(module, sharders)


def make_sharders(
    fused_params: Mapping[str, Any],
    extra: Sequence[ModuleSharder[nn.Module]] = (),
    owner: str = "RecShardStrategy",
    qcomms: QuantizedComms | None = None,
) -> list[ModuleSharder[nn.Module]]:
    """A sharder for every TorchRec embedding module that trains, each with ``fused_params`` (the fused optimizer
    and FBGEMM's arguments).

    The built-in ones are :class:`EBCSharder`, TorchRec's ``EmbeddingCollectionSharder`` and
    ``FeatureProcessedEmbeddingBagCollectionSharder`` (position-weighted tables) and :class:`MCEBCSharder` /
    :class:`MCECSharder` (managed collision). A sharder in ``extra`` replaces the built-in one for its module type,
    and an ``extra`` EBC/EC sharder is also what the feature-processed and managed-collision sharders shard their
    tables with. An ``extra`` embedding sharder keeps every ``fused_params`` entry it sets and gets the others from
    ``fused_params``: the fused optimizer derived from ``configure_optimizers`` reaches it too (it is a copy: the
    user's sharder is left as it was). ``qcomms`` quantizes the built-in sharders' all-to-alls (an ``extra`` sharder
    keeps its own ``qcomm_codecs_registry``).

    Raises:
        ValueError: if an ``extra`` sharder sets an optimizer entry (``optimizer``, ``learning_rate``, ...) that
            differs from the one ``fused_params`` derives, naming both.
    """
    fused, codecs = dict(fused_params), qcomms_registry(qcomms)
    given = {s.module_type: _with_fused_params(s, fused, owner) for s in extra}
    ebc = given.get(EmbeddingBagCollection) or EBCSharder(fused_params=dict(fused), qcomm_codecs_registry=codecs)
    ec = given.get(EmbeddingCollection) or EmbeddingCollectionSharder(
        fused_params=dict(fused), qcomm_codecs_registry=codecs
    )
    built_in: list[ModuleSharder[nn.Module]] = [
        ebc,
        ec,
        FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder=ebc, qcomm_codecs_registry=codecs),
        MCEBCSharder(
            ebc_sharder=ebc,
            mc_sharder=ManagedCollisionCollectionSharder(),
            qcomm_codecs_registry=codecs,
        ),
        MCECSharder(
            ec_sharder=ec,
            mc_sharder=ManagedCollisionCollectionSharder(),
            qcomm_codecs_registry=codecs,
        ),
    ]
    by_type: dict[type, ModuleSharder[nn.Module]] = {s.module_type: s for s in built_in}
    by_type.update(given)
    return list(by_type.values())


def _with_fused_params(
    sharder: ModuleSharder[nn.Module], fused: Mapping[str, Any], owner: str
) -> ModuleSharder[nn.Module]:
    own = _compat.sharder_fused_params(sharder)
    if own is None:
        return sharder  # not an embedding sharder: nothing of ours to pass in
    conflicts = [k for k in _OPTIMIZER_KEYS if k in own and k in fused and own[k] != fused[k]]
    if conflicts:
        raise ValueError(
            f"{owner}: the sharder {type(sharder).__name__} sets the embedding optimizer "
            + ", ".join(f"{k}={own[k]!r}" for k in conflicts)
            + " in its fused_params, but the optimizer derived from `configure_optimizers` (or "
            "`configure_embedding_optimizer`) has "
            + ", ".join(f"{k}={fused[k]!r}" for k in conflicts)
            + ": the tables would not be trained the way the module says. HINT: leave the optimizer out of the "
            "sharder's fused_params (the strategy passes it in), or declare the same one in the module."
        )
    # TorchRec's own sharders become the ones that run row-wise on CPU too (a subclass, no other change): a user who
    # passes TorchRec's managed-collision sharder gets what TorchRec gives on CUDA, not "no available sharding type".
    upgrades: dict[type, type] = {
        EmbeddingBagCollectionSharder: EBCSharder,
        ManagedCollisionEmbeddingBagCollectionSharder: MCEBCSharder,
        ManagedCollisionEmbeddingCollectionSharder: MCECSharder,
    }
    return _compat.with_sharder_fused_params(sharder, {**fused, **own}, upgrades)


def plan_module(
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    *,
    module_types: Sequence[type[nn.Module]],
    constraints: Mapping[str, TableConstraints],
    topology: TopologyConfig | None,
    world_size: int,
    local_world_size: int,
    device_type: str,
    pg: dist.ProcessGroup | None,
    qcomms: QuantizedComms | None = None,
    preset: DevicePreset | None = None,
    batch_size: int | None = None,
) -> tuple[ShardingPlan, list | None]:
    """Plan every table of ``module`` (user constraints over the device defaults), on rank 0 when distributed.
    ``local_world_size``: ranks per host (the planner's intra- vs inter-host costs depend on it).

    Returns:
        the plan, and the planner's chosen sharding options with its estimates (``None`` where it did not plan).
    """
    planner = planner_for_module(
        module,
        module_types=module_types,
        constraints=constraints,
        topology=topology,
        world_size=world_size,
        local_world_size=local_world_size,
        device_type=device_type,
        qcomms=qcomms,
        preset=preset,
        batch_size=batch_size,
    )
    plan = plan_sharding(module, sharders, planner, pg)
    return plan, _compat.planner_sharding_options(planner)


def planner_for_module(
    module: nn.Module,
    *,
    module_types: Sequence[type[nn.Module]],
    constraints: Mapping[str, TableConstraints],
    topology: TopologyConfig | None,
    world_size: int,
    local_world_size: int,
    device_type: str,
    qcomms: QuantizedComms | None = None,
    preset: DevicePreset | None = None,
    batch_size: int | None = None,
) -> EmbeddingShardingPlanner:
    """The planner :func:`plan_module` plans ``module`` with (user constraints over the device defaults)."""
    tables = embedding_tables(module, module_types)
    return make_planner(
        world_size=world_size,
        device_type=device_type,
        topology=topology,
        local_world_size=local_world_size,
        constraints={**default_constraints(tables, device_type, qcomms), **constraints},
        preset=preset,
        batch_size=batch_size,
    )
