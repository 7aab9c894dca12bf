"""lightning_rec._planner.request: the planner's one input, and what it resolves."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_rec._planner.topology import DEVICE_PRESETS
from lightning_rec.config import QuantizedComms, TableConstraints, TopologyConfig
from tests.planner.tables import Tiny, request


def test_ranks_per_host_preset_and_batch_come_from_the_topology_unless_given() -> None:
    plain = request(Tiny(), world_size=4)
    assert (plain.ranks_per_host, plain.device, plain.batch) == (4, None, 512)
    topology = TopologyConfig(local_world_size=2, preset="cpu", batch_size=64)
    ruled = request(Tiny(), world_size=4, topology=topology)
    assert (ruled.ranks_per_host, ruled.device, ruled.batch) == (2, DEVICE_PRESETS["cpu"], 64)
    given = dataclasses.replace(ruled, preset=DEVICE_PRESETS["h100"], batch_size=32, device_type="cuda")
    assert (given.device.name, given.batch) == ("h100", 32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        given.world_size = 8  # type: ignore[misc]


def test_the_users_constraints_win_over_the_device_defaults() -> None:
    req = request(Tiny(), constraints={"user": TableConstraints(sharding_types=["table_wise"])})
    allowed = req.all_constraints
    assert allowed["user"].sharding_types == ["table_wise"]
    assert allowed["odd"].sharding_types == ["data_parallel"], "6 wide: the fused kernels refuse it"
    assert "data_parallel" not in allowed["hist"].sharding_types, "a sequence table on CPU"
    int8 = request(Tiny(), qcomms=QuantizedComms.of("int8")).all_constraints
    assert "row_wise" not in int8["item"].sharding_types, "int8 cannot carry row-wise on CPU"
