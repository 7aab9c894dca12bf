"""What the planner is asked, in one object: which tables, under which constraints, with which sharders and fused
optimizers, for which ranks. :func:`lightning_rec._planner.planner.make_plan` takes one and gives one plan and its
report; ``fit`` (``ShardingConfig.shard``) and ``lightning-rec plan`` (``plan_cluster``) both build one with
``ShardingConfig.request``, so the plan made on a laptop for a topology is the plan ``fit`` makes there.

Example::

    tables = TableInventory.of(model)
    request = PlanRequest(tables, world_size=16, local_world_size=8, device_type="cuda",
                          sharders=make_sharders(EmbeddingOptimizer("adagrad", lr=0.1).to_fused_params()),
                          preset=DEVICE_PRESETS["h100"])
    plan, report = make_plan(model, request)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from lightning_rec._planner.constants import DEFAULT_BATCH_SIZE
from lightning_rec._planner.devices import default_constraints
from lightning_rec._planner.inventory import TableInventory
from lightning_rec._planner.report import PlanReport
from lightning_rec._planner.topology import DevicePreset, default_preset
from lightning_rec.config import QuantizedComms, TableConstraints, TopologyConfig

__all__ = ["PlanRequest"]


@dataclass(frozen=True, eq=False)
class PlanRequest:
    """One planning question (immutable; build it with ``ShardingConfig.request``).

    Args:
        tables: the model's tables, taken once (see :class:`~lightning_rec._planner.inventory.TableInventory`).
        world_size: ranks to plan for.
        local_world_size: ranks per host, as launched (``topology.local_world_size`` overrides it; see
            :attr:`ranks_per_host`): the planner prices intra- and inter-host all-to-alls differently.
        device_type: ``"cuda"`` or ``"cpu"``.
        sharders: the sharders of every table module, carrying the fused optimizer and FBGEMM's arguments (see
            :func:`~lightning_rec._planner.sharders.make_sharders`).
        constraints: the user's per-table constraints, over :attr:`all_constraints`' device defaults.
        topology: the strategy's :class:`~lightning_rec.TopologyConfig` (memory caps, ranks per host, batch size,
            preset).
        qcomms: quantized comms (int8 on CPU keeps the defaults off row-wise shardings).
        preset: the devices' memory and bandwidths, over the topology's preset (see :attr:`device`).
        batch_size: the cost model's per-rank batch, over the topology's (see :attr:`batch`).
        table_fused_params: each table weight trained by a fused optimizer of its own (its own param group), with
            that optimizer's fused parameters: the sharders see them while planning and sharding.
        optimizer_states: each table weight's optimizer class, whose state the planner's memory estimate adds (see
            :func:`lightning_rec._compat.optimizer_state_for_planner`).
        plan: a plan given by the user: the planner does not run.
        plan_file: the report ``plan`` was read from; checked against this request first.
        owner: who the messages name.
    """

    tables: TableInventory
    world_size: int
    local_world_size: int
    device_type: str
    sharders: Sequence[ModuleSharder[nn.Module]] = ()
    constraints: Mapping[str, TableConstraints] = field(default_factory=dict)
    topology: TopologyConfig | None = None
    qcomms: QuantizedComms | None = None
    preset: DevicePreset | None = None
    batch_size: int | None = None
    table_fused_params: Mapping[Tensor, Mapping[str, Any]] = field(default_factory=dict)
    optimizer_states: Mapping[Tensor, type | None] = field(default_factory=dict)
    plan: ShardingPlan | None = None
    plan_file: PlanReport | None = None
    owner: str = "RecShardStrategy"

    @property
    def ranks_per_host(self) -> int:
        """The planner's local world size: ``topology.local_world_size``, else :attr:`local_world_size`."""
        return (self.topology or TopologyConfig()).ranks_per_host(self.local_world_size)

    @property
    def device(self) -> DevicePreset | None:
        """The preset the planner plans with: :attr:`preset`, else the topology's (``None``: TorchRec's defaults)."""
        return self.preset or default_preset(self.device_type, self.topology)

    @property
    def batch(self) -> int:
        """The cost model's per-rank batch: :attr:`batch_size`, else the topology's, else TorchRec's 512."""
        return self.batch_size or (self.topology.batch_size if self.topology else None) or DEFAULT_BATCH_SIZE

    @property
    def all_constraints(self) -> dict[str, TableConstraints]:
        """The user's constraints over the device's defaults (see
        :func:`~lightning_rec._planner.devices.default_constraints`): what the planner may choose from."""
        return {**default_constraints(self.tables.tables, self.device_type, self.qcomms), **self.constraints}
