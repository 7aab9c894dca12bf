"""Mechanics around TorchRec's ``DistributedModelParallel`` that the strategy's hooks delegate to: dense
materialisation before sharding, finding table parameters and DMP's inner DDP, and the forward redirection
that manual optimization needs."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan
from typing_extensions import override

from lightning_rec import _compat


class ManualOptimizationRedirection(_compat._ForwardRedirection):
    """Forward redirection through DMP that, like Lightning's DDPStrategy, keeps the dense part's DDP reducer out
    of a manual-optimization ``training_step`` (whose backward runs inside the forward)."""

    @override
    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: "pl.LightningModule") -> None:
        ddp = dense_ddp(wrapper_module)
        if ddp is not None and not original_module.automatic_optimization:
            ddp.require_backward_grad_sync = False

    @override
    def on_after_outer_forward(self, wrapper_module: nn.Module, original_module: "pl.LightningModule") -> None:
        ddp = dense_ddp(wrapper_module)
        if ddp is not None and not original_module.automatic_optimization:
            ddp.require_backward_grad_sync = True


def dense_ddp(model: Optional[nn.Module]) -> Optional[DistributedDataParallel]:
    """The DDP wrapper DMP puts around the dense part, if any."""
    inner = getattr(model, "_dmp_wrapped_module", None) if isinstance(model, DistributedModelParallel) else None
    return inner if isinstance(inner, DistributedDataParallel) else None


def table_parameters(module: nn.Module, plan: ShardingPlan) -> List[Tuple[str, nn.Parameter]]:
    """Parameters (by FQN) of the modules ``plan`` sharded."""
    paths = tuple(plan.plan)
    return [
        (n, p) for n, p in module.named_parameters()
        if any(n.startswith(f"{path}.") if path else True for path in paths)
    ]


@torch.no_grad()
def materialize_dense(module: nn.Module, device: torch.device, skip: Sequence[nn.Module]) -> None:
    """Allocate dense parameters still on ``meta`` and move all dense tensors to ``device``.

    Embedding modules (``skip``) are left alone: DMP allocates only the local shards of their tables. Doing
    this before ``configure_optimizers`` keeps parameter identities stable through sharding, so the user's
    optimizer keeps pointing at the parameters that are trained.
    """
    skip_ids = {id(m) for m in skip}

    def visit(mod: nn.Module) -> None:
        if id(mod) in skip_ids:
            return
        params = list(mod.named_parameters(recurse=False))
        if any(p.is_meta for _, p in params):
            mod.to_empty(device=device, recurse=False)
            if hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
        else:
            for _, p in params:
                if p.device != device:
                    p.data = p.data.to(device)
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf is not None and buf.device != device:
                setattr(mod, name, torch.zeros_like(buf, device=device) if buf.is_meta else buf.to(device))
        for child in mod.children():
            visit(child)

    visit(module)


def shard_with_dmp(
    module: nn.Module,
    plan: ShardingPlan,
    sharders: List[ModuleSharder[nn.Module]],
    device: torch.device,
    pg: Optional["torch.distributed.ProcessGroup"],
    static_graph: bool,
    find_unused_parameters: bool,
) -> DistributedModelParallel:
    """Wrap ``module`` in DMP: its tables sharded in place by ``plan``, its dense part in DMP's own DDP."""
    return DistributedModelParallel(
        module,
        env=ShardingEnv.from_process_group(pg) if pg is not None else None,
        device=device,
        plan=plan,
        sharders=sharders,
        data_parallel_wrapper=DefaultDataParallelWrapper(
            static_graph=static_graph, find_unused_parameters=find_unused_parameters
        ),
    )
