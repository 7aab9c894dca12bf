"""``lightning-rec plan``: the plan of a config's model for one cluster, or a sweep over several, printed and
written. The CLI (:mod:`lightning_rec._cli`) parses the flags into :class:`PlanOptions`, builds the model as ``fit``
would (tables on ``meta``) and calls :func:`run_plan`.

Example::

    options = PlanOptions(hosts=[2], devices_per_host=[8], device="h100", output="plans/2x8")
    trainer = {"strategy": RecShardStrategy(...), "accelerator": "gpu", "devices": 8}
    run_plan(model, sharding_of(trainer), options.clusters(trainer), options.output)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_rec._planner.cluster import Cluster, sweep_clusters
from lightning_rec._planner.offline import plan_cluster
from lightning_rec._planner.sweep import format_sweep, sweep, write_sweep_png
from lightning_rec._planner.topology import DEVICE_PRESETS
from lightning_rec._strategy.sharding_config import ShardingConfig

__all__ = ["PlanOptions", "calibration_note", "run_plan", "sharding_of"]

# Measured against the estimates on the 2-core development machine for the bench sizes (benchmarks/plan_calibration.py,
# BENCHMARKS.md "Planner calibration"); `plan` prints the note that applies next to its estimates.
_MEMORY_NOTE = (
    "memory: within 1.05x of the bytes a rank held for its tables and their optimizer state (SGD and Adagrad); it "
    "leaves out the dense layers and the batches."
)


def calibration_note(device_type: str, preset: str | None) -> str:
    """What BENCHMARKS.md "Planner calibration" says of these estimates, as ``plan`` prints it.

    Example::

        >>> "--device cpu" in calibration_note("cpu", None)
        True
    """
    if device_type == "cpu" and preset != "cpu":
        step = (
            "WARNING: step time uses TorchRec's default (GPU) bandwidths: on CPU over gloo it was 28-71x below the "
            "measured embedding step; pass --device cpu for bandwidths measured on CPU."
        )
    elif device_type == "cpu":
        step = (
            "step time (cpu preset): 1.05x of the measured embedding step on 2 gloo processes, 2.7x over on 1 "
            "(TorchRec costs an all-to-all a one-rank job does not make); it leaves out the dense layers."
        )
    else:
        step = (
            "step time: TorchRec's cost model of the tables' lookups and all-to-alls only, not yet checked against a "
            "GPU run here."
        )
    return f"calibration (BENCHMARKS.md 'Planner calibration'): {step} {_MEMORY_NOTE}"


@dataclass(frozen=True)
class PlanOptions:
    """``lightning-rec plan``'s own flags, typed (the model, data and trainer come from ``fit``'s config).

    Args:
        hosts: hosts (nodes), one or several (default: the trainer's ``num_nodes``).
        devices_per_host: ranks per host, one or several (default: the trainer's ``devices``).
        device_type: ``"cuda"`` or ``"cpu"`` (default: the preset's, else the trainer's accelerator); a preset's name
            is taken as ``device``.
        device: a device preset's name (:data:`~lightning_rec._planner.topology.DEVICE_PRESETS`).
        hbm_gb, ddr_gb: memory per rank, GiB, over the preset's.
        batch_size_per_rank: the cost model's batch (default: the strategy's ``topology.batch_size``, else 512).
        output: a directory for the plan files (default: print only).

    Raises:
        ValueError: ``device_type`` names a preset other than ``device``.

    Example::

        >>> PlanOptions(device_type="h100").device, PlanOptions(device_type="h100").device_type
        ('h100', None)
    """

    hosts: Sequence[int] | None = None
    devices_per_host: Sequence[int] | None = None
    device_type: str | None = None
    device: str | None = None
    hbm_gb: float | None = None
    ddr_gb: float | None = None
    batch_size_per_rank: int | None = None
    output: str | None = None

    def __post_init__(self) -> None:
        if self.device_type in DEVICE_PRESETS and self.device_type != "cpu":  # --device-type h100: the preset
            if self.device not in (None, self.device_type):
                raise ValueError(f"--device-type {self.device_type} and --device {self.device} name two devices")
            object.__setattr__(self, "device", self.device_type)
            object.__setattr__(self, "device_type", None)

    def clusters(self, trainer: Mapping[str, Any]) -> list[Cluster]:
        """The clusters to plan for, the trainer's config (``num_nodes``, ``devices``, ``accelerator``) filling in
        what the flags leave out, smallest first.

        Raises:
            ValueError: a preset of another device type, or no host or device.
        """
        accelerator = str(trainer.get("accelerator") or "")
        device_type = self.device_type or (
            DEVICE_PRESETS[self.device].device_type if self.device else ("cpu" if accelerator == "cpu" else "cuda")
        )
        devices = trainer.get("devices")
        hosts = self.hosts or [int(trainer.get("num_nodes") or 1)]
        per_host = self.devices_per_host or [devices if isinstance(devices, int) and devices > 0 else 1]
        return sweep_clusters(
            hosts,
            per_host,
            device_type=device_type,
            preset=self.device,
            hbm_gb=self.hbm_gb,
            ddr_gb=self.ddr_gb,
            batch_size=self.batch_size_per_rank,
        )


def sharding_of(trainer: Mapping[str, Any], say: Callable[[str], None] = print) -> ShardingConfig:
    """The sharding configuration of the trainer config's strategy, or recshard's defaults (said when the config
    names another strategy)."""
    strategy = trainer.get("strategy")
    sharding = getattr(strategy, "sharding", None)
    if isinstance(sharding, ShardingConfig):
        return sharding
    if strategy not in (None, "recshard", "auto"):
        say(f"note: the config's strategy is {strategy!r}, not recshard; planning with recshard's defaults.")
    return ShardingConfig.from_arguments()


def run_plan(
    model: nn.Module,
    sharding: ShardingConfig,
    clusters: Sequence[Cluster],
    output: str | None = None,
    say: Callable[[str], None] = print,
) -> None:
    """Plan ``model`` for one cluster (the plan as a table, with the calibration note; ``output``: ``plan.json`` and
    ``plan.png``) or several (one row each; ``output``: ``sweep.json``, ``sweep.png`` and one ``plan_HxD.json`` per
    cluster that fits).

    Raises:
        DoesNotFit: the model does not fit the one cluster (a sweep gives such a cluster a row saying why).
    """
    if output:
        os.makedirs(output, exist_ok=True)
    if len(clusters) == 1:
        _plan_one(model, sharding, clusters[0], output, say)
    else:
        _plan_sweep(model, sharding, clusters, output, say)


def _plan_one(
    model: nn.Module, sharding: ShardingConfig, cluster: Cluster, output: str | None, say: Callable[[str], None]
) -> None:
    report = plan_cluster(model, sharding, cluster)
    say(
        f"plan for {cluster.describe()}: {report.world_size} rank(s), {report.local_world_size} per host, "
        f"{report.device_type}, preset {report.preset or 'none (TorchRec defaults)'}, batch {report.batch_size} "
        "per rank"
    )
    say(report.format_table())
    say(calibration_note(report.device_type, report.preset))
    if output:
        report.write_json(os.path.join(output, "plan.json"))
        report.write_png(os.path.join(output, "plan.png"))
        say(
            f"wrote {os.path.join(output, 'plan.json')} and plan.png; train with it: lightning-rec fit ... "
            f"--trainer.strategy.init_args.plan={os.path.join(output, 'plan.json')}"
        )


def _plan_sweep(
    model: nn.Module,
    sharding: ShardingConfig,
    clusters: Sequence[Cluster],
    output: str | None,
    say: Callable[[str], None],
) -> None:
    rows = sweep(model, sharding, clusters)
    say(format_sweep(rows))
    preset = clusters[0].device()
    say(calibration_note(clusters[0]._device_type, preset.name if preset else None))
    for row in rows:
        if row.error:
            say(f"{row.cluster.describe()}: {row.error}")
    if output:
        with open(os.path.join(output, "sweep.json"), "w") as f:
            json.dump([row.to_dict() for row in rows], f, indent=2)
        write_sweep_png(rows, os.path.join(output, "sweep.png"))
        for row in rows:
            if row.report is not None:
                name = f"plan_{row.cluster.hosts}x{row.cluster.devices_per_host}.json"
                row.report.write_json(os.path.join(output, name))
        say(f"wrote {os.path.join(output, 'sweep.json')}, sweep.png and one plan_HxD.json per topology that fits")
