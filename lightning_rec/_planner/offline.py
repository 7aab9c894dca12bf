"""Plan a cluster from one machine: the sharding plan ``fit`` would make for ``H`` hosts of ``D`` devices, made here
with the model's tables on the ``meta`` device (nothing allocated, no process group), with the planner's estimates.

* :func:`plan_cluster`: one topology (a :class:`~lightning_rec._planner.cluster.Cluster`), a
  :class:`~lightning_rec._planner.report.PlanReport` (``plan.json`` + picture, the report ``fit`` writes);
  ``RecShardStrategy(plan="plan.json")`` trains with it; a model that does not fit raises
  :class:`~lightning_rec._planner.fit.DoesNotFit`;
* :func:`planning_optimizer`: the fused optimizer ``fit`` would derive, without a Trainer;
* :func:`build_on_meta`: a model with its tables on ``meta``.

Several topologies at once: :mod:`lightning_rec._planner.sweep`; ``lightning-rec plan``:
:mod:`lightning_rec._planner.command`.

Example::

    module = build_on_meta(lambda: MyModel(...))                # tables on "meta": nothing allocated
    report = plan_cluster(module, ShardingConfig.from_arguments(), Cluster(hosts=2, devices_per_host=8, preset="h100"))
    print(report.format_table())
    report.write_json("plan.json")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torchrec.distributed.planner.types import PlannerError

from lightning_rec import _compat
from lightning_rec._planner.cluster import Cluster
from lightning_rec._planner.fit import does_not_fit
from lightning_rec._planner.inventory import TableInventory
from lightning_rec._planner.report import PlanReport
from lightning_rec._strategy.sharding_config import ShardingConfig
from lightning_rec.config import EmbeddingOptimizer

__all__ = ["build_on_meta", "plan_cluster", "planning_optimizer"]


def planning_optimizer(
    module: nn.Module,
    sharding: ShardingConfig,
    device_type: str,
    warn: Callable[[str], None] = print,
    tables: TableInventory | None = None,
) -> tuple[EmbeddingOptimizer, Any]:
    """The fused optimizer (and per-table ones) ``fit`` would derive for ``module``: its
    ``configure_embedding_optimizer()``, the strategy's, or from ``configure_optimizers()`` (called here without a
    Trainer; one that needs the Trainer is skipped with a warning, and the tables are planned with the default
    optimizer's state). The optimizer's state is part of each table's memory, so the plan depends on it.
    ``tables``: ``module``'s inventory, when the caller took it already."""
    tables = tables or sharding.inventory(module)
    ids = tables.table_parameter_ids
    optimizers: list[Any] = []
    configure_optimizers = getattr(module, "configure_optimizers", None)
    if callable(configure_optimizers):
        try:
            optimizers = _compat.parse_optimizers(configure_optimizers())
        except Exception as err:  # noqa: BLE001 - e.g. a configure_optimizers reading self.trainer
            warn(
                f"note: {type(module).__name__}.configure_optimizers() did not run without a Trainer "
                f"({type(err).__name__}: {err}); planning with the strategy's or the default embedding optimizer."
            )
    emb_opt, _, per_table = sharding.embedding_optimizer_for(
        module, optimizers, lambda p: id(p) in ids, device_type, tables=tables
    )
    return emb_opt, per_table


def plan_cluster(
    module: nn.Module,
    sharding: ShardingConfig,
    cluster: Cluster,
    *,
    optimizer: tuple[EmbeddingOptimizer, Any] | None = None,
    candidates: Sequence[Cluster] = (),
    tables: TableInventory | None = None,
) -> PlanReport:
    """The plan ``fit`` would make for ``module`` on ``cluster``, with the planner's estimates.

    Args:
        module: the model; its tables may (and for big ones should) be on ``meta``.
        sharding: the strategy's sharding configuration (constraints, topology, sharders, fused params, qcomms):
            ``strategy.sharding``, or ``ShardingConfig.from_arguments(...)`` with the strategy's arguments.
        optimizer: the fused optimizer and per-table ones (default: :func:`planning_optimizer`).
        candidates: bigger topologies to suggest when the model does not fit (default: ``cluster`` with 2, 4,
            ... 64 times the hosts).
        tables: ``module``'s inventory, when the caller took it already (a sweep takes it once).

    Raises:
        DoesNotFit: naming the tables that do not fit, their memory, and the smallest candidate that holds them.
    """
    tables = tables or sharding.inventory(module)
    emb_opt, per_table = optimizer or planning_optimizer(module, sharding, cluster._device_type, tables=tables)

    def plans(on: Cluster) -> PlanReport:
        return sharding.plan_for(
            module,
            emb_opt,
            world_size=on.world_size,
            local_world_size=on.devices_per_host,
            device_type=on._device_type,
            per_table=per_table,
            preset=on.device(sharding.topology),
            batch_size=on.batch_size,
            tables=tables,
        )

    try:
        return plans(cluster)
    except PlannerError:
        request = sharding.request(
            tables,
            emb_opt,
            per_table,
            world_size=cluster.world_size,
            local_world_size=cluster.devices_per_host,
            device_type=cluster._device_type,
            preset=cluster.device(sharding.topology),
            batch_size=cluster.batch_size,
        )
        raise does_not_fit(module, request, cluster, plans, candidates) from None


def build_on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    """``factory()`` with tensors created on ``meta`` unless it names a device: a 500 GB model's tables cost nothing.

    Example::

        model = build_on_meta(lambda: DLRMModule(sparse_features=features, num_dense_features=13))
    """
    with torch.device("meta"):
        return factory()
