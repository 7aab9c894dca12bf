"""lightning_rec._planner.cluster: a topology to plan for."""

from __future__ import annotations

import pytest

from lightning_rec._planner.cluster import Cluster, sweep_clusters
from lightning_rec._planner.topology import DEVICE_PRESETS
from lightning_rec.config import TopologyConfig


def test_a_cluster_resolves_its_preset_and_device() -> None:
    c = Cluster(2, 8, preset="h100", hbm_gb=40)
    assert (c.world_size, c.device_type, c.describe()) == (16, "cuda", "2 x 8 h100")
    assert c.preset is DEVICE_PRESETS["h100"] and c.device().hbm_gb == 40, "the memory override on the preset"
    assert (
        Cluster(1, 2, "cpu").device() is None
        and Cluster(1, 2, "cpu").device(TopologyConfig(preset="cpu")).name == "cpu"
    )
    assert Cluster(1, 1, "cuda", ddr_gb=8).device().name == "custom"


def test_impossible_clusters_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one host"):
        Cluster(0, 8)
    with pytest.raises(ValueError, match="'h100' is a cuda device, not cpu. HINT"):
        Cluster(1, 2, "cpu", preset="h100")


def test_a_sweep_is_every_combination_smallest_first_and_bigger_keeps_the_device() -> None:
    clusters = sweep_clusters([4, 1], [2, 1], device_type="cpu")
    assert [(c.hosts, c.devices_per_host) for c in clusters] == [(1, 1), (1, 2), (4, 1), (4, 2)]
    assert all(
        b.preset is DEVICE_PRESETS["a100-40g"] and b.ddr_gb == 1
        for b in Cluster(1, 2, preset="a100-40g", ddr_gb=1).bigger()
    )
