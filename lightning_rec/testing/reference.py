"""Pieces of the hand-written TorchRec training loop that recshard is compared with (tests, bench, benchmarks)."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn


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
