"""What TorchRec's planner is told about the machines: named device presets (memory and bandwidths) and the
``Topology`` built from them, the job's shape and the user's :class:`~lightning_rec.TopologyConfig` overrides.

``fit`` and ``lightning-rec plan`` both build their topology here, so a plan made on a laptop for a topology and the
one ``fit`` computes on that topology are the same plan.

Example::

    >>> DEVICE_PRESETS["h100"].hbm_gb, DEVICE_PRESETS["h100"].device_type
    (80.0, 'cuda')
    >>> topology = make_topology(world_size=16, local_world_size=8, device_type="cuda", preset="a100-40g")
    >>> topology.world_size, topology.local_world_size, topology.devices[0].storage.hbm // 2**30
    (16, 8, 40)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchrec.distributed.planner.types import Topology

from lightning_rec import _compat
from lightning_rec._planner.constants import GIB
from lightning_rec.config import TopologyConfig

__all__ = ["DEVICE_PRESETS", "DevicePreset", "default_preset", "make_topology", "preset_named", "presets_text"]


@dataclass(frozen=True)
class DevicePreset:
    """One kind of rank as the planner sees it: its memory and bandwidths (``None``: TorchRec's default).

    Args:
        name: what ``--device`` and ``TopologyConfig(preset=...)`` call it.
        device_type: ``"cuda"`` or ``"cpu"``.
        hbm_gb: device memory per rank, GiB (0 on CPU).
        ddr_gb: host memory per rank, GiB (on CPU, where the tables live).
        hbm_bw: device memory bandwidth, GB/s (10^9 bytes/s, as vendors quote it).
        ddr_bw: host memory bandwidth as the lookup kernels use it, GB/s.
        intra_host_bw: all-to-all bandwidth between ranks of one host, GB/s (NVLink; gloo on CPU).
        inter_host_bw: all-to-all bandwidth between hosts, GB/s per rank (the NIC).
        source: where the numbers come from.

    Example::

        >>> DevicePreset("mine", "cuda", hbm_gb=24.0).with_memory(hbm_gb=20.0).hbm_gb
        20.0
    """

    name: str
    device_type: str
    hbm_gb: float | None = None
    ddr_gb: float | None = None
    hbm_bw: float | None = None
    ddr_bw: float | None = None
    intra_host_bw: float | None = None
    inter_host_bw: float | None = None
    source: str = ""

    def with_memory(self, hbm_gb: float | None = None, ddr_gb: float | None = None) -> DevicePreset:
        """This preset with the given memory (``None`` keeps the preset's)."""
        return replace(
            self,
            hbm_gb=self.hbm_gb if hbm_gb is None else hbm_gb,
            ddr_gb=self.ddr_gb if ddr_gb is None else ddr_gb,
        )

    def hardware(self) -> dict[str, float | None]:
        """The preset as TorchRec's ``HardwareConfig`` arguments (bytes, and bytes per millisecond)."""

        def per_ms(gb_per_s: float | None) -> float | None:
            return None if gb_per_s is None else gb_per_s * 1e9 / 1000

        return {
            "hbm_cap_bytes": None if self.hbm_gb is None else int(self.hbm_gb * GIB),
            "ddr_cap_bytes": None if self.ddr_gb is None else int(self.ddr_gb * GIB),
            "hbm_mem_bw": per_ms(self.hbm_bw),
            "ddr_mem_bw": per_ms(self.ddr_bw),
            "intra_host_bw": per_ms(self.intra_host_bw),
            "inter_host_bw": per_ms(self.inter_host_bw),
        }


# Vendor figures for one GPU of the usual 8-GPU host (DGX/HGX): HBM size and bandwidth (SXM), NVLink bandwidth (both
# directions, as TorchRec's 600 GB/s default counts an A100's), one NIC per GPU (400 Gb/s NDR for H100/H200, 200 Gb/s
# HDR for A100), host memory divided by 8.
#
# The CPU preset's bandwidths are measured on the 2-core development machine (benchmarks/plan_calibration.py,
# BENCHMARKS.md "Planner calibration"): TorchRec's defaults model a GPU's lookups and NVLink, which made its
# step-time estimates of gloo jobs too small by orders of magnitude.
DEVICE_PRESETS: dict[str, DevicePreset] = {
    p.name: p
    for p in (
        DevicePreset("h100", "cuda", 80.0, 256.0, 3350.0, 100.0, 900.0, 50.0, "H100 SXM5 80GB, DGX H100"),
        DevicePreset("h200", "cuda", 141.0, 256.0, 4800.0, 100.0, 900.0, 50.0, "H200 SXM 141GB, HGX H200"),
        DevicePreset("a100-80g", "cuda", 80.0, 256.0, 2039.0, 80.0, 600.0, 25.0, "A100 SXM4 80GB, DGX A100"),
        DevicePreset("a100-40g", "cuda", 40.0, 128.0, 1555.0, 80.0, 600.0, 25.0, "A100 SXM4 40GB, DGX A100"),
        DevicePreset(
            "cpu", "cpu", None, 128.0, None, 1.7, 0.35, 12.5, "measured on 2 cores: FBGEMM CPU lookups, gloo all-to-all"
        ),
    )
}


def preset_named(name: str) -> DevicePreset:
    """The preset called ``name``, or an error listing the known ones.

    Example::

        >>> preset_named("h100").device_type
        'cuda'
    """
    try:
        return DEVICE_PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown device preset {name!r}. HINT: choose one of {', '.join(DEVICE_PRESETS)}, or give the memory "
            "and device type yourself."
        ) from None


def presets_text() -> str:
    """The device presets in one line (``lightning-rec plan --help``).

    Example::

        >>> presets_text().split("; ")[0]
        'h100: cuda, 80 GiB HBM, 256 GiB DDR'
    """
    return "; ".join(
        f"{p.name}: {p.device_type}{f', {p.hbm_gb:g} GiB HBM' if p.hbm_gb else ''}, {p.ddr_gb:g} GiB DDR"
        for p in DEVICE_PRESETS.values()
    )


def default_preset(device_type: str, topology: TopologyConfig | None = None) -> DevicePreset | None:
    """The preset a job plans with: ``topology.preset`` if set, else none: TorchRec's own defaults, on CPU too (the
    ``cpu`` preset's measured bandwidths make the planner favour data-parallel tables on gloo; a fit keeps the plans
    it always made unless asked, see BENCHMARKS.md "Planner calibration").

    Example::

        >>> default_preset("cpu"), default_preset("cpu", TopologyConfig(preset="cpu")).name
        (None, 'cpu')
    """
    if topology is not None and topology.preset:
        return preset_named(topology.preset)
    return None


def make_topology(
    *,
    world_size: int,
    local_world_size: int,
    device_type: str,
    topology: TopologyConfig | None = None,
    preset: str | DevicePreset | None = None,
) -> Topology:
    """TorchRec's ``Topology`` for ``world_size`` ranks, ``local_world_size`` per host: the memory and bandwidths of
    ``preset`` (default: :func:`default_preset`), under ``topology``'s ``hbm_cap``/``ddr_cap``.

    Raises:
        ValueError: if the preset is for another device type than ``device_type``.
    """
    if isinstance(preset, str):
        preset = preset_named(preset)
    chosen = preset or default_preset(device_type, topology)
    if chosen is not None and chosen.device_type != device_type:
        raise ValueError(
            f"device preset {chosen.name!r} is a {chosen.device_type} device, but the job runs on {device_type}. "
            f"HINT: pick a {device_type} preset ({', '.join(n for n, p in DEVICE_PRESETS.items() if p.device_type == device_type)})."
        )
    topo = topology or TopologyConfig()
    return _compat.create_topology(
        world_size=world_size,
        local_world_size=local_world_size,
        device_type=device_type,
        hbm_cap=topo.hbm_cap,
        ddr_cap=topo.ddr_cap,
        hardware=chosen.hardware() if chosen is not None else None,
    )
