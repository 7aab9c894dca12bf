"""Mechanics around TorchRec's ``DistributedModelParallel`` that the strategy's hooks delegate to: dense
materialisation before sharding, the DMP wrapping and what a sharded module remembers of it, finding table
parameters and DMP's inner DDP, and the forward redirection that manual optimization needs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import SupportsIndex

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan
from typing_extensions import override

from lightning_rec import _compat
from lightning_rec._inputs.specs import ModuleInputs
from lightning_rec._planner.inventory import TableInventory
from lightning_rec._planner.report import PlanReport
from lightning_rec._strategy.cpu_lookup import install_cpu_lookup
from lightning_rec._strategy.optim import is_fused_parameter
from lightning_rec._strategy.unsharded import capture_weights, output_orders, restore_output_order, restore_weights
from lightning_rec._tables import dense_parameter_ids, embedding_modules
from lightning_rec.config import EmbeddingOptimizer

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
            of :mod:`lightning_rec._inputs` compare batches with; the sharded modules no longer expose their configs).
        dense_ids: the ``id`` of each dense parameter inside an embedding module (a feature processor's position
            weights): trained by the dense optimizer, not the tables'.
        table_optimizers: tables trained by a fused optimizer of their own (their param group's), by table name.
    """

    dmp: DistributedModelParallel
    plan: ShardingPlan
    embedding_optimizer: EmbeddingOptimizer
    report: PlanReport | None = None
    inputs: dict[str, ModuleInputs] = field(default_factory=dict)
    dense_ids: frozenset[int] = frozenset()
    table_optimizers: dict[str, EmbeddingOptimizer] = field(default_factory=dict)

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        # The runtime state of a fit (its process group, its DMP): a pickled or copied module leaves it behind, as
        # a LightningModule leaves its `_trainer`, and the copy is an unsharded module (torch.save, deepcopy, EMA).
        return _left_behind, ()


def _left_behind() -> None:
    return None


def sharded_state(module: nn.Module | None) -> ShardedState | None:
    """The :class:`ShardedState` of a module sharded by :func:`shard_module`, else ``None``."""
    return getattr(module, _SHARDED_STATE_ATTR, None) if module is not None else None


class ManualOptimizationRedirection(_compat._ForwardRedirection):
    """Forward redirection through DMP that, like Lightning's DDPStrategy, keeps the dense part's DDP reducer out
    of a manual-optimization ``training_step`` (whose backward runs inside the forward)."""

    @override
    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: pl.LightningModule) -> None:
        ddp = dense_ddp(wrapper_module)
        if ddp is not None and not original_module.automatic_optimization:
            ddp.require_backward_grad_sync = False

    @override
    def on_after_outer_forward(self, wrapper_module: nn.Module, original_module: pl.LightningModule) -> None:
        ddp = dense_ddp(wrapper_module)
        if ddp is not None and not original_module.automatic_optimization:
            ddp.require_backward_grad_sync = True


def dense_ddp(model: nn.Module | None) -> DistributedDataParallel | None:
    """The DDP wrapper DMP puts around the dense part, if any."""
    inner = _compat.dmp_inner_module(model) if isinstance(model, DistributedModelParallel) else None
    return inner if isinstance(inner, DistributedDataParallel) else None


def table_parameters(
    module: nn.Module, plan: ShardingPlan, dense_ids: frozenset[int] = frozenset()
) -> list[tuple[str, nn.Parameter]]:
    """Parameters (by FQN) of the tables of the modules ``plan`` sharded (``dense_ids``: their other parameters)."""
    paths = tuple(plan.plan)
    return [
        (n, p)
        for n, p in module.named_parameters()
        if any(n.startswith(f"{path}.") if path else True for path in paths) and id(p) not in dense_ids
    ]


@torch.no_grad()
def materialize_dense(module: nn.Module, device: torch.device, skip: Sequence[nn.Module]) -> None:
    """Allocate dense parameters and buffers still on ``meta``, initialise them, and move all dense tensors to
    ``device``.

    Embedding modules (``skip``) are left alone: DMP allocates only the local shards of their tables. Doing
    this before ``configure_optimizers`` keeps parameter identities stable through sharding, so the user's
    optimizer keeps pointing at the parameters that are trained.

    A tensor on ``meta`` holds no values, so it can only be initialised by its module's ``reset_parameters()``
    (or ``_reset_parameters()``, as ``nn.MultiheadAttention`` names it). Each one is allocated filled with a
    sentinel, the module's reset runs, and any tensor the reset did not write (a module without a reset, a
    ``torch.randn`` parameter the reset does not know, a buffer computed in ``__init__``) is refused: training on
    uninitialised memory would run on silently.

    Raises:
        ValueError: naming every tensor nothing initialised, with its module's class, before anything is sharded.
    """
    skip_ids = {id(m) for m in skip}
    replaced: dict[int, torch.Tensor] = {}  # meta tensor -> its allocation (tied weights stay tied)
    fresh: dict[str, tuple[nn.Module, str]] = {}  # path -> (module, attribute) of every tensor allocated here

    def visit(mod: nn.Module, path: str) -> None:
        if id(mod) in skip_ids:
            return
        for name, child in mod.named_children():  # children first: a parent's reset may (re)initialise them
            visit(child, f"{path}.{name}" if path else name)
        allocated = _allocate_meta(mod, device, replaced)
        if allocated:
            reset = getattr(mod, "reset_parameters", None) or getattr(mod, "_reset_parameters", None)
            if callable(reset):
                reset()
            fresh.update({f"{path}.{name}" if path else name: (mod, name) for name in allocated})
        for p in mod.parameters(recurse=False):
            if p.device != device:
                p.data = p.data.to(device)
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf is not None and buf.device != device:
                setattr(mod, name, buf.to(device))

    visit(module, "")
    uninitialised = [path for path, (mod, name) in fresh.items() if _still_sentinel(getattr(mod, name))]
    if uninitialised:
        owners = sorted({type(fresh[n][0]).__name__ for n in uninitialised})
        raise ValueError(
            f"RecShardStrategy: {', '.join(repr(n) for n in uninitialised)} "
            f"{'was' if len(uninitialised) == 1 else 'were'} created on the meta device and nothing initialises "
            f"{'it' if len(uninitialised) == 1 else 'them'}: a meta tensor holds no values, and "
            f"{' / '.join(owners)} has no `reset_parameters()` that writes "
            f"{'it' if len(uninitialised) == 1 else 'them'}, so training would start from uninitialised memory. "
            "HINT: give the module a `reset_parameters()` that initialises every parameter and buffer it owns "
            "(e.g. `nn.init.normal_(self.pos_embedding, std=0.02)`), or build the dense layers on CPU and put only "
            "the EmbeddingBagCollection/EmbeddingCollection on meta."
        )


def _allocate_meta(mod: nn.Module, device: torch.device, replaced: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace ``mod``'s own meta parameters and buffers by sentinel-filled tensors on ``device``; returns them."""
    fresh: dict[str, torch.Tensor] = {}
    for name, p in list(mod.named_parameters(recurse=False)):
        if p.is_meta:
            if id(p) not in replaced:
                replaced[id(p)] = nn.Parameter(_sentinel_like(p, device), requires_grad=p.requires_grad)
            setattr(mod, name, replaced[id(p)])
            fresh[name] = replaced[id(p)]
    for name, buf in list(mod.named_buffers(recurse=False)):
        if buf is not None and buf.is_meta:
            if id(buf) not in replaced:
                replaced[id(buf)] = _sentinel_like(buf, device)
            setattr(mod, name, replaced[id(buf)])
            fresh[name] = replaced[id(buf)]
    return fresh


def _sentinel_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An allocation no initialiser leaves behind: NaN for floats, the dtype's minimum for integers."""
    out = torch.empty_like(t, device=device)
    if t.dtype.is_floating_point or t.dtype.is_complex:
        out.fill_(float("nan"))
    elif t.dtype == torch.bool:
        out.fill_(False)  # no value is a sentinel for bool; buffers of flags start False
    else:
        out.fill_(torch.iinfo(t.dtype).min)
    return out


def _still_sentinel(t: torch.Tensor) -> bool:
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).any())
    return bool((t == torch.iinfo(t.dtype).min).all())


def shard_with_dmp(
    module: nn.Module,
    plan: ShardingPlan,
    sharders: list[ModuleSharder[nn.Module]],
    device: torch.device,
    pg: torch.distributed.ProcessGroup | None,
    static_graph: bool,
    find_unused_parameters: bool,
) -> DistributedModelParallel:
    """Wrap ``module`` in DMP: its tables sharded in place by ``plan``, its dense part in DMP's own DDP (with
    several ranks: see :class:`DenseDataParallel`).

    Example::

        dmp = shard_with_dmp(model, plan, make_sharders({}), torch.device("cpu"), dist.group.WORLD,
                             static_graph=True, find_unused_parameters=False)
    """
    return RecDistributedModelParallel(
        module,
        env=ShardingEnv.from_process_group(pg) if pg is not None else None,
        device=device,
        plan=plan,
        sharders=sharders,
        data_parallel_wrapper=DenseDataParallel(
            static_graph=static_graph, find_unused_parameters=find_unused_parameters
        ),
    )


class RecDistributedModelParallel(DistributedModelParallel):
    """TorchRec's DMP whose pickle (and deep copy) is the module it wraps: ``torch.save(trainer.model)`` saves the
    LightningModule, as it does under ``ddp``, instead of failing on DMP's process group. The wrapper itself is
    runtime state, rebuilt by the strategy."""

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Callable[[nn.Module], nn.Module], tuple[nn.Module]]:
        return _unwrapped, (self.module,)


def _unwrapped(module: nn.Module) -> nn.Module:
    return module


class DenseDataParallel(DefaultDataParallelWrapper):
    """TorchRec's DDP wrapper of the dense part, left out in a single process.

    With one rank, DDP's all-reduce averages each gradient with itself, yet every step still pays its forward
    bookkeeping, its backward hooks and a collective (~0.3 ms on a CPU core, ~1 ms of host time on a GPU at a tiny
    step, BENCHMARKS.md); the gradients, and so the training, are the same without it.

    Example::

        DistributedModelParallel(model, plan=plan, sharders=sharders, data_parallel_wrapper=DenseDataParallel())
    """

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:  # noqa: D102
        if env.world_size == 1:
            return
        super().wrap(dmp, env, device)


def shard_module(
    module: pl.LightningModule,
    plan: ShardingPlan,
    sharders: list[ModuleSharder[nn.Module]],
    device: torch.device,
    pg: torch.distributed.ProcessGroup | None,
    *,
    embedding_optimizer: EmbeddingOptimizer,
    report: PlanReport | None,
    inputs: dict[str, ModuleInputs] | None = None,
    module_types: Sequence[type[nn.Module]] = (),
    static_graph: bool,
    find_unused_parameters: bool,
    fast_cpu_lookup: bool = True,
) -> ShardedState:
    """:func:`shard_with_dmp`, make the sharded modules behave like the unsharded ones (the weights they held, their
    output order: see :mod:`lightning_rec._strategy.unsharded`), then remember the result on ``module`` (see
    :func:`sharded_state`)."""
    held = capture_weights(module, module_types)
    orders = output_orders(module, module_types)
    dense_ids = dense_parameter_ids(list(embedding_modules(module, module_types).values()))
    dmp = shard_with_dmp(
        module,
        plan,
        sharders,
        device,
        pg,
        # DDP's static-graph first step assumes backward runs after forward returns; manual optimization breaks that.
        static_graph=static_graph and module.automatic_optimization,
        find_unused_parameters=find_unused_parameters,
    )
    restore_weights(dmp.module, held, pg)
    del held  # the unsharded tables can be freed now
    restore_output_order(dmp.module, orders)
    if fast_cpu_lookup and device.type == "cpu":
        install_cpu_lookup(dmp)
    state = ShardedState(
        dmp=dmp,
        plan=plan,
        embedding_optimizer=embedding_optimizer,
        report=report,
        inputs=dict(inputs or {}),
        dense_ids=dense_ids,
    )
    # A plain attribute (not a submodule): the module stays the root of its own state_dict.
    object.__setattr__(module, _SHARDED_STATE_ATTR, state)
    return state


def prepare_for_optimizers(
    module: nn.Module, tables: TableInventory, device: torch.device, state: ShardedState | None
) -> Callable[[torch.Tensor], bool]:
    """Get ``module`` ready for ``configure_optimizers`` and tell table parameters from dense ones.

    Before the first sharding, the dense part is materialised on ``device`` (tables, ``tables``' modules, stay where
    they are: DMP allocates their shards). A sharded module's tables are the modules its plan names.

    Returns:
        a predicate: is this parameter (a table's, or a fused TBE view) owned by the embedding optimizer?
    """
    if state is None:
        ids = tables.table_parameter_ids
        materialize_dense(module, device, skip=list(tables.modules.values()))
    else:  # already sharded (e.g. validate, then fit)
        ids = frozenset(id(p) for _, p in table_parameters(module, state.plan, state.dense_ids))
    return lambda p: id(p) in ids or is_fused_parameter(p)


def unfused_table_parameters(module: nn.Module, state: ShardedState) -> dict[str, nn.Parameter]:
    """Table parameters that no fused optimizer owns (TorchRec keeps ``data_parallel`` tables on a dense
    kernel on CPU); they got new parameters when sharded and need an optimizer of their own."""
    return {n: p for n, p in table_parameters(module, state.plan, state.dense_ids) if not is_fused_parameter(p)}
