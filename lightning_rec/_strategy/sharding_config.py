"""What the user asked of the sharding (tables' constraints, the machine's topology, extra sharders, a fixed plan,
the fused optimizer, FBGEMM's arguments), normalised once, and the steps that use it: check a model against it,
settle the fused embedding optimizer, ask the planner (one :class:`~lightning_rec._planner.request.PlanRequest`, see
:mod:`lightning_rec._planner`) and shard. :class:`~lightning_rec.RecShardStrategy` builds one from its arguments
(``strategy.sharding``) and calls it from its hooks; it knows nothing of Lightning's loop.

Not to be confused with TorchRec's ``ModuleSharder`` objects: those are one of its fields (``sharders``).

Example::

    sharding = ShardingConfig.from_arguments(constraints={"t_item": {"sharding_types": ["column_wise"]}})
    sharding.check_model(model, device_type="cpu")                  # before any distributed work
    tables = sharding.inventory(model)                              # the tables, walked once per setup
    emb_opt, lr_source, per_table = sharding.embedding_optimizer_for(model, optimizers, is_embedding, "cpu", tables)
    state = sharding.shard(model, emb_opt, world_size=2, num_processes=2, device=torch.device("cpu"),
                           per_table=per_table, tables=tables)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from lightning_rec import _compat
from lightning_rec._inputs.specs import input_specs
from lightning_rec._planner.devices import check_qcomms, validate_constraints
from lightning_rec._planner.files import read_plan, to_sharding_plan
from lightning_rec._planner.inventory import TableInventory
from lightning_rec._planner.planner import make_plan
from lightning_rec._planner.report import PlanReport
from lightning_rec._planner.request import PlanRequest
from lightning_rec._planner.sharders import make_sharders
from lightning_rec._planner.topology import DevicePreset
from lightning_rec._strategy.dmp import ShardedState, shard_module
from lightning_rec._strategy.optim import (
    TableOptimizers,
    bounds_check_params,
    optimizer_state_class,
    resolve_embedding_optimizer,
)
from lightning_rec._strategy.quiet import torchrec_noise_silenced
from lightning_rec._tables import sharded_module_types
from lightning_rec.config import BoundsCheck, EmbeddingOptimizer, QuantizedComms, TableConstraints, TopologyConfig

__all__ = ["ShardingConfig"]


@dataclass
class ShardingConfig:
    """The strategy's sharding configuration (see :class:`~lightning_rec.RecShardStrategy`'s arguments of the same
    names) and the steps it drives. Build it with :meth:`from_arguments`, which accepts YAML-shaped dicts; a strategy
    holds its own as ``strategy.sharding``, and :func:`lightning_rec.plan_cluster` plans with one.

    Example::

        sharding = RecShardStrategy(constraints={"t_item": {"sharding_types": ["column_wise"]}}).sharding
        sharding.constraints["t_item"].sharding_types                   # ['column_wise']
        sharding = ShardingConfig.from_arguments(topology={"preset": "h100"}, qcomms="fp16")
        report = lightning_rec.plan_cluster(model, sharding, lightning_rec.Cluster(2, 8, preset="h100"))
    """

    constraints: dict[str, TableConstraints] = field(default_factory=dict)
    topology: TopologyConfig | None = None
    sharders: list[ModuleSharder[nn.Module]] = field(default_factory=list)
    plan: ShardingPlan | None = None
    plan_file: PlanReport | None = None  # the report `plan` was read from (checked against the run)
    embedding_optimizer: EmbeddingOptimizer | None = None
    fused_params: dict[str, Any] = field(default_factory=dict)
    static_graph: bool = True
    find_unused_parameters: bool = False
    qcomms: QuantizedComms | None = None
    fast_cpu_lookup: bool = True
    owner: str = "RecShardStrategy"  # who the messages name

    @classmethod
    def from_arguments(
        cls,
        *,
        constraints: Mapping[str, TableConstraints | Mapping[str, Any]] | None = None,
        topology: TopologyConfig | Mapping[str, Any] | None = None,
        sharders: Sequence[ModuleSharder[nn.Module]] | None = None,
        plan: ShardingPlan | str | os.PathLike[str] | None = None,
        embedding_optimizer: EmbeddingOptimizer | Mapping[str, Any] | None = None,
        fused_params: Mapping[str, Any] | None = None,
        bounds_check: BoundsCheck = "error",
        static_graph: bool = True,
        find_unused_parameters: bool = False,
        qcomms: QuantizedComms | str | Mapping[str, Any] | Any | None = None,
        fast_cpu_lookup: bool = True,
        owner: str = "RecShardStrategy",
    ) -> ShardingConfig:
        """The configuration from the strategy's arguments: dicts become the typed configs, ``bounds_check``
        becomes FBGEMM's ``bounds_check_mode`` (under any ``fused_params`` the user gave), a ``plan`` path is read
        (see :func:`~lightning_rec._planner.files.read_plan`)."""
        plan_file = read_plan(plan, owner) if isinstance(plan, (str, os.PathLike)) else None
        return cls(
            constraints={
                name: c if isinstance(c, TableConstraints) else TableConstraints(**c)
                for name, c in (constraints or {}).items()
            },
            topology=topology
            if topology is None or isinstance(topology, TopologyConfig)
            else TopologyConfig(**topology),
            sharders=list(sharders or []),
            plan=to_sharding_plan(plan_file) if plan_file is not None else plan,
            plan_file=plan_file,
            embedding_optimizer=(
                embedding_optimizer
                if embedding_optimizer is None or isinstance(embedding_optimizer, EmbeddingOptimizer)
                else EmbeddingOptimizer(**embedding_optimizer)
            ),
            fused_params={**bounds_check_params(bounds_check), **dict(fused_params or {})},
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            qcomms=QuantizedComms.of(dict(qcomms) if isinstance(qcomms, Mapping) else qcomms),
            fast_cpu_lookup=fast_cpu_lookup,
            owner=owner,
        )

    @property
    def module_types(self) -> tuple[type[nn.Module], ...]:
        """The module types that get sharded (see :func:`lightning_rec._tables.sharded_module_types`)."""
        return sharded_module_types(self.sharders)

    def inventory(self, module: nn.Module) -> TableInventory:
        """``module``'s tables that get sharded, walked once (see
        :class:`~lightning_rec._planner.inventory.TableInventory`): take it once per setup and pass it on."""
        return TableInventory.of(module, self.module_types)

    def check_model(self, module: nn.Module, device_type: str) -> None:
        """Warn about a model without tables; check the constraints against its tables and ``device_type``."""
        tables = self.inventory(module).tables
        if not tables:
            rank_zero_warn(
                f"{self.owner}: {type(module).__name__} has no EmbeddingBagCollection or "
                "EmbeddingCollection, so there is nothing to shard; it will be trained as plain data parallel. "
                "HINT: use `strategy='ddp'` for models without embedding tables."
            )
        if self.plan is None:
            validate_constraints(self.constraints, tables, device_type)
        check_qcomms(self.qcomms, tables, self.constraints, device_type)

    def embedding_optimizer_for(
        self,
        module: nn.Module,
        optimizers: list[Optimizer],
        is_embedding: Callable[[Tensor], bool],
        device_type: str,
        tables: TableInventory | None = None,
    ) -> tuple[EmbeddingOptimizer, dict[str, Any] | None, TableOptimizers | None]:
        """The fused optimizer (the module's ``configure_embedding_optimizer()``, this configuration's, or derived
        from ``optimizers``), the param group whose learning rate it follows (``None``: its own), and each table's own
        when the tables sit in several param groups (see :func:`~lightning_rec._strategy.optim.resolve_embedding_optimizer`).
        ``tables``: ``module``'s inventory (default: taken here)."""
        tables = tables or self.inventory(module)
        declared = getattr(module, "configure_embedding_optimizer", lambda: None)() or self.embedding_optimizer
        return resolve_embedding_optimizer(
            optimizers,
            is_embedding,
            declared=declared,
            has_tables=bool(tables.tables),
            device_type=device_type,
            owner=self.owner,
            table_weights=tables.weights,
        )

    def shard(
        self,
        module: pl.LightningModule,
        embedding_optimizer: EmbeddingOptimizer,
        *,
        world_size: int,
        num_processes: int,
        device: torch.device,
        per_table: TableOptimizers | None = None,
        tables: TableInventory | None = None,
    ) -> ShardedState:
        """Plan (rank 0, broadcast; or this configuration's ``plan``, checked against this run first), log the plan,
        and shard ``module`` in place with DMP (see :func:`lightning_rec._strategy.dmp.shard_module`); ``per_table``:
        tables trained by their own fused optimizer (TorchRec groups tables by their fused parameters); ``tables``:
        ``module``'s inventory (default: taken here)."""
        pg = dist.group.WORLD if _compat._distributed_is_initialized() else None
        tables = tables or self.inventory(module)
        request = self.request(
            tables,
            embedding_optimizer,
            per_table,
            world_size=world_size,
            local_world_size=num_processes,
            device_type=device.type,
        )
        with torchrec_noise_silenced():
            plan, report = make_plan(module, request, pg)
            rank_zero_info(
                f"{self.owner}: sharding plan over {world_size} rank(s), {request.ranks_per_host} per host\n"
                f"{report.format_table()}"
            )
            with _compat.table_fused_params(request.table_fused_params):  # the sharders build each table's kernels
                state = shard_module(
                    module,
                    plan,
                    list(request.sharders),
                    device,
                    pg,
                    embedding_optimizer=embedding_optimizer,
                    report=report,
                    inputs=input_specs(module, self.module_types),
                    module_types=self.module_types,
                    static_graph=self.static_graph,
                    find_unused_parameters=self.find_unused_parameters,
                    fast_cpu_lookup=self.fast_cpu_lookup,
                )
        state.table_optimizers = {t: opt for t, (opt, _) in (per_table or {}).items()}
        return state

    def check_sharded_with(
        self, state: ShardedState, embedding_optimizer: EmbeddingOptimizer, per_table: TableOptimizers | None
    ) -> None:
        """Refuse to train a module sharded earlier (a second ``fit``, or ``validate`` first) with another fused
        optimizer than ``embedding_optimizer``/``per_table`` (as :meth:`embedding_optimizer_for` gives them): the fused
        optimizer is part of the sharded kernels.

        Raises:
            RuntimeError: naming both, with the fix.
        """
        rules = {table: opt for table, (opt, _) in (per_table or {}).items()}
        if (embedding_optimizer, rules) != (state.embedding_optimizer, state.table_optimizers):
            raise RuntimeError(
                f"{self.owner}: the model was sharded earlier with embedding optimizer "
                f"{state.table_optimizers or state.embedding_optimizer}, but now asks for "
                f"{rules or embedding_optimizer}. The fused optimizer is part of the "
                "sharded kernels. HINT: declare it with `configure_embedding_optimizer()` so that every run "
                "uses the same one, or build a fresh model."
            )

    def request(
        self,
        tables: TableInventory,
        embedding_optimizer: EmbeddingOptimizer,
        per_table: TableOptimizers | None = None,
        *,
        world_size: int,
        local_world_size: int,
        device_type: str,
        preset: DevicePreset | None = None,
        batch_size: int | None = None,
    ) -> PlanRequest:
        """What the planner is asked for ``tables`` under this configuration: ``world_size`` ranks,
        ``local_world_size`` per host as launched, on ``device_type``, the tables trained by ``embedding_optimizer``
        (``per_table``: those with one of their own); ``preset``/``batch_size`` replace the topology's.

        Raises:
            ValueError: an extra sharder whose fused optimizer differs from ``embedding_optimizer`` (see
                :func:`~lightning_rec._planner.sharders.make_sharders`).
        """
        own = self.table_fused_params(tables, per_table)
        return PlanRequest(
            tables=tables,
            world_size=world_size,
            local_world_size=local_world_size,
            device_type=device_type,
            sharders=self.sharders_for(embedding_optimizer),
            constraints=self.constraints,
            topology=self.topology,
            qcomms=self.qcomms,
            preset=preset,
            batch_size=batch_size,
            table_fused_params=own,
            optimizer_states=self.optimizer_state_classes(tables, embedding_optimizer, own),
            plan=self.plan,
            plan_file=self.plan_file,
            owner=self.owner,
        )

    def plan_for(
        self,
        module: nn.Module,
        embedding_optimizer: EmbeddingOptimizer,
        *,
        world_size: int,
        local_world_size: int,
        device_type: str,
        per_table: TableOptimizers | None = None,
        preset: DevicePreset | None = None,
        batch_size: int | None = None,
        tables: TableInventory | None = None,
    ) -> PlanReport:
        """The plan (with the planner's estimates) :meth:`shard` would make for ``world_size`` ranks,
        ``local_world_size`` per host, on ``device_type``, made here in this process, without any process group:
        ``module``'s tables may sit on the ``meta`` device. ``preset``/``batch_size`` replace the topology's.

        Raises:
            torchrec.distributed.planner.types.PlannerError: if the tables do not fit.
        """
        request = self.request(
            tables or self.inventory(module),
            embedding_optimizer,
            per_table,
            world_size=world_size,
            local_world_size=local_world_size,
            device_type=device_type,
            preset=preset,
            batch_size=batch_size,
        )
        with torchrec_noise_silenced():
            return make_plan(module, request)[1]

    def sharders_for(self, embedding_optimizer: EmbeddingOptimizer) -> list[ModuleSharder[nn.Module]]:
        """The sharders of every table module, with ``embedding_optimizer`` and this configuration's FBGEMM
        arguments and quantized comms (see :func:`~lightning_rec._planner.sharders.make_sharders`)."""
        return make_sharders(
            {**embedding_optimizer.to_fused_params(), **self.fused_params},
            self.sharders,
            owner=self.owner,
            qcomms=self.qcomms,
        )

    def optimizer_state_classes(
        self,
        tables: TableInventory,
        embedding_optimizer: EmbeddingOptimizer,
        own: Mapping[Tensor, Mapping[str, Any]] | None = None,
    ) -> dict[Tensor, type | None]:
        """Each table weight's optimizer class as TorchRec's planner counts its state: the table's own fused
        optimizer (``own``, see :meth:`table_fused_params`; else one the weight already names) or
        ``embedding_optimizer``."""
        default = embedding_optimizer.to_fused_params().get("optimizer")
        given = {id(w): fused for w, fused in (own or {}).items()}
        classes: dict[Tensor, type | None] = {}
        for weight in tables.weights.values():
            fused = given.get(id(weight)) or (getattr(weight, "_optimizer_kwargs", None) or [{}])[0] or {}
            classes[weight] = optimizer_state_class(fused.get("optimizer", default))
        return classes

    def table_fused_params(
        self, tables: TableInventory, per_table: TableOptimizers | None
    ) -> dict[Tensor, Mapping[str, Any]]:
        """Each table weight trained by a fused optimizer of its own (``per_table``), with that optimizer's fused
        parameters: what TorchRec's sharders read from the weight while planning and sharding."""
        if not per_table:
            return {}
        return {tables.weights[t]: opt.to_fused_params() for t, (opt, _) in per_table.items() if t in tables.weights}
