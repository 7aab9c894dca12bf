"""Mechanics around TorchRec's ``DistributedModelParallel`` that the strategy's hooks delegate to: dense
materialisation before sharding, the DMP wrapping and what a sharded module remembers of it, finding table
parameters and DMP's inner DDP, and the forward redirection that manual optimization needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan
from typing_extensions import override

from lightning_rec import _compat
from lightning_rec.kjt_check import ModuleInputs
from lightning_rec.optim import EmbeddingOptimizer, is_fused_parameter
from lightning_rec.plan_report import PlanReport
from lightning_rec.sharding import embedding_modules

_SHARDED_STATE_ATTR = "_lightning_rec_sharded"


@dataclass
class ShardedState:
    """What a sharded module remembers across trainers: its DMP wrapper, how it was sharded, and the plan
    report (so a later ``fit`` with another Trainer can still write it).

    Args:
        dmp: the ``DistributedModelParallel`` wrapper.
        plan: the plan it was sharded with.
        embedding_optimizer: the fused optimizer baked into its kernels.
        report: the sharding-plan report built when it was sharded.
        inputs: what each sharded embedding module expects of its input, by module path (what the input checks
            of :mod:`lightning_rec.inputs` compare batches with; the sharded modules no longer expose their configs).
    """

    dmp: DistributedModelParallel
    plan: ShardingPlan
    embedding_optimizer: EmbeddingOptimizer
    report: Optional[PlanReport] = None
    inputs: Dict[str, ModuleInputs] = field(default_factory=dict)


def sharded_state(module: Optional[nn.Module]) -> Optional[ShardedState]:
    """The :class:`ShardedState` of a module sharded by :func:`shard_module`, else ``None``."""
    return getattr(module, _SHARDED_STATE_ATTR, None) if module is not None else None


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
    """Wrap ``module`` in DMP: its tables sharded in place by ``plan``, its dense part in DMP's own DDP.

    Example::

        dmp = shard_with_dmp(model, plan, make_sharders({}), torch.device("cpu"), dist.group.WORLD,
                             static_graph=True, find_unused_parameters=False)
    """
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


def shard_module(
    module: "pl.LightningModule",
    plan: ShardingPlan,
    sharders: List[ModuleSharder[nn.Module]],
    device: torch.device,
    pg: Optional["torch.distributed.ProcessGroup"],
    *,
    embedding_optimizer: EmbeddingOptimizer,
    report: Optional[PlanReport],
    inputs: Optional[Dict[str, ModuleInputs]] = None,
    static_graph: bool,
    find_unused_parameters: bool,
) -> ShardedState:
    """:func:`shard_with_dmp`, then remember the result on ``module`` (see :func:`sharded_state`)."""
    dmp = shard_with_dmp(
        module, plan, sharders, device, pg,
        # DDP's static-graph first step assumes backward runs after forward returns; manual optimization breaks that.
        static_graph=static_graph and module.automatic_optimization,
        find_unused_parameters=find_unused_parameters,
    )
    state = ShardedState(
        dmp=dmp, plan=plan, embedding_optimizer=embedding_optimizer, report=report, inputs=dict(inputs or {})
    )
    # A plain attribute (not a submodule): the module stays the root of its own state_dict.
    object.__setattr__(module, _SHARDED_STATE_ATTR, state)
    return state


def prepare_for_optimizers(
    module: nn.Module, module_types: Sequence[Type[nn.Module]], device: torch.device, state: Optional[ShardedState]
) -> Callable[[torch.Tensor], bool]:
    """Get ``module`` ready for ``configure_optimizers`` and tell table parameters from dense ones.

    Before the first sharding, the dense part is materialised on ``device`` (tables stay where they are:
    DMP allocates their shards). A sharded module's tables are the modules its plan names.

    Returns:
        a predicate: is this parameter (a table's, or a fused TBE view) owned by the embedding optimizer?
    """
    if state is None:
        emb_modules = list(embedding_modules(module, module_types).values())
        ids = {id(p) for m in emb_modules for p in m.parameters()}
        materialize_dense(module, device, skip=emb_modules)
    else:  # already sharded (e.g. validate, then fit)
        ids = {id(p) for _, p in table_parameters(module, state.plan)}
    return lambda p: id(p) in ids or is_fused_parameter(p)


def unfused_table_parameters(module: nn.Module, plan: ShardingPlan) -> Dict[str, nn.Parameter]:
    """Table parameters that no fused optimizer owns (TorchRec keeps ``data_parallel`` tables on a dense
    kernel on CPU); they got new parameters when sharded and need an optimizer of their own."""
    return {n: p for n, p in table_parameters(module, plan) if not is_fused_parameter(p)}
