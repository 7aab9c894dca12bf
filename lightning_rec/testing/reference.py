"""Pieces of the hand-written TorchRec training loop that recshard is compared with (tests, bench, benchmarks):
the model sharded by TorchRec's planner and ``DistributedModelParallel`` (:func:`reference_dmp`), and the fused +
dense ``CombinedOptimizer`` (:func:`reference_optimizer`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["reference_dmp", "reference_optimizer"]


def reference_dmp(
    model: nn.Module,
    sharders: Sequence[Any],
    device: torch.device,
    constraints: Mapping[str, Mapping[str, Any]] | None = None,
    plan: Any | None = None,
    **topology: Any,
) -> nn.Module:
    """``model`` sharded as a TorchRec user shards it by hand: TorchRec's planner over the default process group
    (every rank gets rank 0's plan), then ``DistributedModelParallel``.

    Args:
        model: the unsharded model (tables on ``meta`` or built with rows).
        sharders: the TorchRec sharders, with the fused optimizer in their ``fused_params``.
        device: where the shards and the dense part go.
        constraints: table name -> ``ParameterConstraints`` arguments, e.g. ``{"t_user": {"sharding_types":
            ["column_wise"]}}``.
        plan: a ready ``ShardingPlan`` instead of planning.
        topology: more ``Topology`` arguments (``hbm_cap=...``); ``world_size`` and ``compute_device`` come from the
            process group and ``device``.

    Returns:
        The ``DistributedModelParallel``.

    Example::

        sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
        dmp = reference_dmp(model, [sharder], torch.device("cpu"), {"t_user": {"sharding_types": ["table_wise"]}})
    """
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    if plan is None:
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=dist.get_world_size(), compute_device=device.type, **topology),
            constraints={t: ParameterConstraints(**c) for t, c in (constraints or {}).items()},
        )
        plan = planner.collective_plan(model, list(sharders), dist.group.WORLD)
    return DistributedModelParallel(model, device=device, plan=plan, sharders=list(sharders))


def reference_optimizer(
    dmp: nn.Module, dense: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
) -> torch.optim.Optimizer:
    """The optimizer a TorchRec user writes by hand: the tables' fused optimizer and a dense one, combined.

    Args:
        dmp: a ``DistributedModelParallel`` (its ``fused_optimizer`` updates the tables in the backward pass).
        dense: builds the optimizer of the other parameters from them, e.g. ``lambda ps: torch.optim.SGD(ps, lr=0.1)``.

    Returns:
        A ``torchrec.optim.keyed.CombinedOptimizer`` of ``dmp.fused_optimizer`` and ``dense`` over the parameters
        that no fused optimizer updates.

    Example::

        optimizer = reference_optimizer(dmp, lambda ps: torch.optim.Adagrad(ps, lr=0.1))
        optimizer.zero_grad(); loss = dmp(batch); loss.backward(); optimizer.step()
    """
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    wrapped = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())), dense)
    return CombinedOptimizer([dmp.fused_optimizer, wrapped])
