"""A topology to plan for from one machine: :class:`Cluster` (``hosts`` x ``devices_per_host`` ranks of one device
kind, a preset's memory and bandwidths), and the clusters of a sweep.

Example::

    >>> [c.describe() for c in sweep_clusters([1, 2], [8], preset="h100")]
    ['1 x 8 h100', '2 x 8 h100']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_rec._planner.constants import CANDIDATE_SCALES
from lightning_rec._planner.topology import DevicePreset, default_preset, preset_named
from lightning_rec.config import TopologyConfig

__all__ = ["Cluster", "sweep_clusters"]


@dataclass(frozen=True)
class Cluster:
    """A topology to plan for: ``hosts`` x ``devices_per_host`` ranks of one device kind.

    Args:
        hosts: hosts (nodes).
        devices_per_host: ranks per host (GPUs, or processes on CPU).
        device_type: ``"cuda"`` or ``"cpu"`` (default: the preset's, else ``"cuda"``).
        preset: a :data:`~lightning_rec._planner.topology.DEVICE_PRESETS` name or preset (default: the ``cpu``
            preset on CPU, TorchRec's defaults on CUDA, as ``fit`` plans).
        hbm_gb, ddr_gb: memory per rank, GiB, over the preset's.
        batch_size: per-rank batch size of the cost model (default: the strategy's topology's, else TorchRec's 512).

    Example::

        >>> c = Cluster(hosts=2, devices_per_host=8, preset="h100")
        >>> c.world_size, c.device_type, c.describe()
        (16, 'cuda', '2 x 8 h100')
    """

    hosts: int = 1
    devices_per_host: int = 1
    device_type: str | None = None
    preset: str | DevicePreset | None = None
    hbm_gb: float | None = None
    ddr_gb: float | None = None
    batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.devices_per_host < 1:
            raise ValueError(f"a cluster needs at least one host and one device per host, got {self.describe()}")
        preset = preset_named(self.preset) if isinstance(self.preset, str) else self.preset
        if preset is not None and self.device_type is not None and preset.device_type != self.device_type:
            raise ValueError(
                f"device preset {preset.name!r} is a {preset.device_type} device, not {self.device_type}. HINT: drop "
                "--device-type, or pick a preset of that type."
            )
        object.__setattr__(self, "preset", preset)
        object.__setattr__(self, "device_type", self.device_type or (preset.device_type if preset else "cuda"))

    @property
    def world_size(self) -> int:
        """All ranks: hosts x devices per host."""
        return self.hosts * self.devices_per_host

    @property
    def _device_type(self) -> str:
        """``device_type``, which ``__post_init__`` always sets."""
        assert self.device_type is not None
        return self.device_type

    @property
    def _preset(self) -> DevicePreset | None:
        """``preset``, which ``__post_init__`` resolves from its name."""
        assert not isinstance(self.preset, str)
        return self.preset

    def device(self, topology: TopologyConfig | None = None) -> DevicePreset | None:
        """The preset the planner is given (with the memory overrides), ``None`` for TorchRec's defaults."""
        preset = self._preset or default_preset(self._device_type, topology)
        if self.hbm_gb is None and self.ddr_gb is None:
            return preset
        base = preset or DevicePreset("custom", self._device_type)
        return base.with_memory(self.hbm_gb, self.ddr_gb)

    def bigger(self) -> list[Cluster]:
        """This cluster with 2, 4, ... 64 times the hosts (:data:`~lightning_rec._planner.constants.CANDIDATE_SCALES`):
        the topologies tried for a model that does not fit.

        Example::

            >>> [c.hosts for c in Cluster(1, 8, preset="h100").bigger()][:3]
            [2, 4, 8]
        """
        return [replace(self, hosts=self.hosts * k) for k in CANDIDATE_SCALES]

    def describe(self) -> str:
        """``"2 x 8 h100"``: hosts x devices per host and the device."""
        name = self.preset.name if isinstance(self.preset, DevicePreset) else (self.preset or self.device_type)
        return f"{self.hosts} x {self.devices_per_host} {name}"


def sweep_clusters(hosts: Sequence[int], devices_per_host: Sequence[int], **device: Any) -> list[Cluster]:
    """Every hosts x devices-per-host combination, smallest world first."""
    clusters = [Cluster(h, d, **device) for h in hosts for d in devices_per_host]
    return sorted(clusters, key=lambda c: (c.world_size, c.hosts))
