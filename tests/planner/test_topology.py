"""lightning_rec._planner.topology: presets and TorchRec's Topology built from them."""

from __future__ import annotations

import pytest

from lightning_rec._planner.constants import GIB
from lightning_rec._planner.topology import DEVICE_PRESETS, default_preset, make_topology, preset_named, presets_text
from lightning_rec.config import TopologyConfig


def test_a_preset_sets_memory_and_the_topologys_cap_overrides_it() -> None:
    topology = make_topology(world_size=4, local_world_size=2, device_type="cuda", preset="a100-40g")
    assert topology.devices[0].storage.hbm == 40 * GIB and topology.local_world_size == 2
    capped = make_topology(
        world_size=4, local_world_size=2, device_type="cuda", preset="a100-40g", topology=TopologyConfig(hbm_cap=GIB)
    )
    assert capped.devices[0].storage.hbm == GIB


def test_presets_are_named_listed_and_checked_against_the_device() -> None:
    assert preset_named("h200").hbm_gb == 141.0
    with pytest.raises(ValueError, match="unknown device preset 'tpu'.*h100"):
        preset_named("tpu")
    with pytest.raises(ValueError, match="'cpu' is a cpu device, but the job runs on cuda"):
        make_topology(world_size=1, local_world_size=1, device_type="cuda", preset="cpu")
    assert all(name in presets_text() for name in DEVICE_PRESETS)
    assert default_preset("cuda") is None and default_preset("cpu", TopologyConfig(preset="h100")).name == "h100"
