"""Plan a cluster from one machine: the sharding plan ``fit`` would make for ``H`` hosts of ``D`` devices, made here
with the model's tables on the ``meta`` device (nothing allocated, no process group), with the planner's estimates.

``lightning-rec plan`` (:mod:`lightning_rec._cli`) reads a config as ``fit`` does and calls these:

* :func:`plan_cluster`: one topology, a :class:`~lightning_rec._strategy.plan_report.PlanReport` (``plan.json`` +
  picture, the report ``fit`` writes); ``RecShardStrategy(plan="plan.json")`` trains with it;
* :func:`sweep`: several topologies, one :class:`SweepRow` each (memory per rank, step time, samples/s, imbalance);
* :class:`DoesNotFit`: a model that does not fit, the tables that do not, what they need, and the smallest of the
  candidate topologies that holds them.

Example::

    module = build_on_meta(lambda: MyModel(...))                # tables on "meta": nothing allocated
    report = plan_cluster(module, ShardingConfig.from_arguments(), Cluster(hosts=2, devices_per_host=8, preset="h100"))
    print(report.format_table())
    report.write_json("plan.json")
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.distributed.planner.types import PlannerError

from lightning_rec import _compat
from lightning_rec._strategy.dmp import dense_parameter_ids
from lightning_rec._strategy.plan_report import PlanReport
from lightning_rec._strategy.sharding import planner_for_module, table_storage_options
from lightning_rec._strategy.sharding_config import ShardingConfig
from lightning_rec._strategy.topology import DEVICE_PRESETS, DevicePreset, default_preset, preset_named
from lightning_rec._tables import embedding_modules
from lightning_rec.config import EmbeddingOptimizer, TopologyConfig

__all__ = [
    "Cluster",
    "DoesNotFit",
    "SweepRow",
    "build_on_meta",
    "calibration_note",
    "format_sweep",
    "plan_cluster",
    "planning_optimizer",
    "sweep",
    "sweep_clusters",
    "write_sweep_png",
]

_GB = 1024**3
_MAX_ATTEMPTS = 4  # bigger topologies planned to find one that holds a model that does not fit

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
class Cluster:
    """A topology to plan for: ``hosts`` x ``devices_per_host`` ranks of one device kind.

    Args:
        hosts: hosts (nodes).
        devices_per_host: ranks per host (GPUs, or processes on CPU).
        device_type: ``"cuda"`` or ``"cpu"`` (default: the preset's, else ``"cuda"``).
        preset: a :data:`~lightning_rec._strategy.topology.DEVICE_PRESETS` name or preset (default: the ``cpu``
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

    def describe(self) -> str:
        """``"2 x 8 h100"``: hosts x devices per host and the device."""
        name = self.preset.name if isinstance(self.preset, DevicePreset) else (self.preset or self.device_type)
        return f"{self.hosts} x {self.devices_per_host} {name}"


def planning_optimizer(
    module: nn.Module, sharding: ShardingConfig, device_type: str, warn: Callable[[str], None] = print
) -> tuple[EmbeddingOptimizer, Any]:
    """The fused optimizer (and per-table ones) ``fit`` would derive for ``module``: its
    ``configure_embedding_optimizer()``, the strategy's, or from ``configure_optimizers()`` (called here without a
    Trainer; one that needs the Trainer is skipped with a warning, and the tables are planned with the default
    optimizer's state). The optimizer's state is part of each table's memory, so the plan depends on it."""
    modules = list(embedding_modules(module, sharding.module_types).values())
    dense = dense_parameter_ids(modules)
    ids = {id(p) for m in modules for p in m.parameters() if id(p) not in dense}
    optimizers: list[Any] = []
    configure_optimizers = getattr(module, "configure_optimizers", None)
    if callable(configure_optimizers):
        try:
            optimizers = _compat.parse_optimizers(configure_optimizers())
        except Exception as err:  # noqa: BLE001 - e.g. a configure_optimizers reading self.trainer
            warn(
                f"note: {type(module).__name__}.configure_optimizers() did not run without a Trainer "
                f"({type(err).__name__}: {err}); planning with the strategy's or the default embedding optimizer."
            )
    emb_opt, _, per_table = sharding.embedding_optimizer_for(module, optimizers, lambda p: id(p) in ids, device_type)
    return emb_opt, per_table


def plan_cluster(
    module: nn.Module,
    sharding: ShardingConfig,
    cluster: Cluster,
    *,
    optimizer: tuple[EmbeddingOptimizer, Any] | None = None,
    candidates: Sequence[Cluster] = (),
) -> PlanReport:
    """The plan ``fit`` would make for ``module`` on ``cluster``, with the planner's estimates.

    Args:
        module: the model; its tables may (and for big ones should) be on ``meta``.
        sharding: the strategy's sharding configuration (constraints, topology, sharders, fused params, qcomms).
        optimizer: the fused optimizer and per-table ones (default: :func:`planning_optimizer`).
        candidates: bigger topologies to suggest when the model does not fit (default: ``cluster`` with 2, 4,
            ... 64 times the hosts).

    Raises:
        DoesNotFit: naming the tables that do not fit, their memory, and the smallest candidate that holds them.
    """
    emb_opt, per_table = optimizer or planning_optimizer(module, sharding, cluster._device_type)
    try:
        return _plan(module, sharding, cluster, emb_opt, per_table)
    except PlannerError as err:
        raise DoesNotFit.explain(module, sharding, cluster, emb_opt, per_table, err, candidates) from None


def _plan(module: nn.Module, sharding: ShardingConfig, cluster: Cluster, emb_opt: Any, per_table: Any) -> PlanReport:
    return sharding.plan_for(
        module,
        emb_opt,
        world_size=cluster.world_size,
        local_world_size=(sharding.topology or TopologyConfig()).ranks_per_host(cluster.devices_per_host),
        device_type=cluster._device_type,
        per_table=per_table,
        preset=cluster.device(sharding.topology),
        batch_size=cluster.batch_size,
    )


class DoesNotFit(ValueError):
    """The tables do not fit the topology: which ones, how much they need, and what would hold them.

    Args:
        message: the whole explanation.
        needs: each table's smallest memory over its sharding options, bytes, largest first.
        smallest_fit: the smallest candidate topology that planned, if any.
    """

    def __init__(self, message: str, needs: dict[str, int], smallest_fit: Cluster | None) -> None:
        super().__init__(message)
        self.needs = needs
        self.smallest_fit = smallest_fit

    @classmethod
    def explain(
        cls,
        module: nn.Module,
        sharding: ShardingConfig,
        cluster: Cluster,
        emb_opt: EmbeddingOptimizer,
        per_table: Any,
        error: PlannerError,
        candidates: Sequence[Cluster] = (),
    ) -> DoesNotFit:
        """Read the planner's failure: the tables' smallest memory, the rank capacity, bigger topologies tried."""
        device = cluster.device(sharding.topology)
        local = (sharding.topology or TopologyConfig()).ranks_per_host(cluster.devices_per_host)
        planner = planner_for_module(
            module,
            module_types=sharding.module_types,
            constraints=sharding.constraints,
            topology=sharding.topology,
            world_size=cluster.world_size,
            local_world_size=local,
            device_type=cluster._device_type,
            qcomms=sharding.qcomms,
            preset=device,
            batch_size=cluster.batch_size,
        )
        with sharding.per_table_fused_params(module, per_table):
            sharders = sharding.sharders_for(emb_opt)
            with _compat.optimizer_state_for_planner(sharding.optimizer_state_classes(module, emb_opt)):
                options = table_storage_options(module, sharders, planner)
        rank = _compat.planner_topology(planner).devices[0].storage
        cap = rank.hbm + rank.ddr  # the planner may also spill to host memory (UVM caching) on CUDA
        needs, piece = {}, {}
        for table, opts in options.items():
            needs[table] = min(sum(s.storage.hbm + s.storage.ddr for s in o.shards) for o in opts)
            piece[table] = min(max(s.storage.hbm + s.storage.ddr for s in o.shards) for o in opts)
        needs = dict(sorted(needs.items(), key=lambda kv: -kv[1]))
        usable = int(cap * (1 - 0.15))  # the planner's storage reservation (sharding.make_planner)
        too_big = [t for t in needs if piece[t] > usable]
        total = sum(needs.values())
        if too_big:
            what = (
                f"{', '.join(f'{t} ({_gb(piece[t])} in its smallest shard)' for t in too_big)} "
                f"{'does' if len(too_big) == 1 else 'do'} not fit on any of these ranks ({_gb(usable)} usable per rank)"
            )
        else:
            largest = list(needs)[: max(1, min(5, len(needs)))]
            what = (
                f"the tables need {_gb(total)} in all, at their smallest (largest: "
                f"{', '.join(f'{t} {_gb(needs[t])}' for t in largest)}), and {cluster.world_size} rank(s) hold "
                f"{_gb(usable * cluster.world_size)} ({_gb(usable)} usable per rank)"
            )
        tried = list(candidates) or [
            Cluster(
                cluster.hosts * k,
                cluster.devices_per_host,
                cluster.device_type,
                cluster.preset,
                cluster.hbm_gb,
                cluster.ddr_gb,
                cluster.batch_size,
            )
            for k in (2, 4, 8, 16, 32, 64)
        ]
        smallest, attempts = None, 0
        for candidate in sorted(tried, key=lambda c: c.world_size):
            if candidate.world_size <= cluster.world_size and candidate.device() == cluster.device():
                continue
            rank_cap = _rank_capacity(candidate, sharding.topology)
            if rank_cap is not None and rank_cap * candidate.world_size < total:
                continue  # cannot hold them by arithmetic alone: no need to ask the planner
            if attempts == _MAX_ATTEMPTS:
                break
            attempts += 1
            try:
                _plan(module, sharding, candidate, emb_opt, per_table)
            except PlannerError:
                continue
            smallest = candidate
            break
        hint = (
            f"the smallest of the topologies tried that holds them is {smallest.describe()} ({smallest.world_size} "
            "ranks)"
            if smallest is not None
            else f"none of the topologies tried ({', '.join(c.describe() for c in tried[: attempts or len(tried)])}) holds "
            "them either"
        )
        return cls(
            f"The model does not fit {cluster.describe()} ({cluster.world_size} rank(s), "
            f"{_device_text(device, cluster)}): {what}. HINT: {hint}; or shrink the tables, or lower the batch size "
            f"(the planner assumed {_compat.planner_batch_size(planner)} per rank).",
            needs,
            smallest,
        )


def _rank_capacity(cluster: Cluster, topology: TopologyConfig | None) -> int | None:
    """Usable bytes per rank of ``cluster`` after the planner's 15% reservation, if its device says."""
    device = cluster.device(topology)
    if device is None:
        return None
    hbm = (
        (topology.hbm_cap if topology and topology.hbm_cap else (device.hbm_gb or 0) * _GB)
        if cluster.device_type == "cuda"
        else 0
    )
    ddr = topology.ddr_cap if topology and topology.ddr_cap else (device.ddr_gb or 0) * _GB
    return int((hbm + ddr) * 0.85) or None


def _device_text(device: DevicePreset | None, cluster: Cluster) -> str:
    if device is None:
        return f"{cluster.device_type}, TorchRec's default memory"
    hbm = f"{device.hbm_gb:g} GiB HBM + " if device.hbm_gb else ""
    return f"{hbm}{device.ddr_gb:g} GiB DDR per rank" if device.ddr_gb is not None else f"{device.name}"


def _gb(nbytes: float) -> str:
    return f"{nbytes / _GB:,.1f} GiB" if nbytes >= 0.1 * _GB else f"{nbytes / 2**20:,.1f} MiB"


@dataclass
class SweepRow:
    """One topology of a :func:`sweep`.

    Args:
        cluster: the topology.
        report: its plan, or ``None`` if the model does not fit.
        error: why it does not fit (``None`` if it does).
    """

    cluster: Cluster
    report: PlanReport | None
    error: str | None = None

    @property
    def samples_per_s(self) -> float | None:
        """Global samples per second the planner's step time allows (all ranks' batches per step)."""
        if self.report is None or not self.report.step_ms or not self.report.batch_size:
            return None
        return self.cluster.world_size * self.report.batch_size / (self.report.step_ms / 1000)

    def to_dict(self) -> dict[str, Any]:
        """One JSON row: the topology, memory of the fullest rank, step time, samples/s, imbalance."""
        r = self.report
        return {
            "hosts": self.cluster.hosts,
            "devices_per_host": self.cluster.devices_per_host,
            "world_size": self.cluster.world_size,
            "device": self.cluster.describe(),
            "fits": r is not None,
            "max_memory_bytes": r.max_memory_bytes if r else None,
            "step_ms": r.step_ms if r else None,
            "samples_per_s": self.samples_per_s,
            "imbalance": r.imbalance if r else None,
            "error": self.error,
        }


def sweep(module: nn.Module, sharding: ShardingConfig, clusters: Sequence[Cluster]) -> list[SweepRow]:
    """:func:`plan_cluster` for each topology; one that does not fit gets a row with its reason.

    Example::

        rows = sweep(model, ShardingConfig.from_arguments(), [Cluster(h, 8, preset="h100") for h in (1, 2, 4, 8)])
        print(format_sweep(rows))
    """
    rows = []
    optimizer = planning_optimizer(module, sharding, clusters[0]._device_type) if clusters else None
    for cluster in clusters:
        try:
            rows.append(
                SweepRow(cluster, plan_cluster(module, sharding, cluster, optimizer=optimizer, candidates=clusters))
            )
        except DoesNotFit as err:
            rows.append(SweepRow(cluster, None, str(err)))
    return rows


def format_sweep(rows: Sequence[SweepRow]) -> str:
    """The sweep as a fixed-width table: one row per topology.

    Example::

        hosts  devices/host  ranks  memory/rank (GiB)  step (ms)  samples/s  imbalance mem/cost
            1             8      8              61.20      3.512  1,166,393  1.01 / 1.03
    """
    header = ("hosts", "devices/host", "ranks", "memory/rank (GiB)", "step (ms)", "samples/s", "imbalance mem/cost")
    body = []
    for row in rows:
        d = row.to_dict()
        if not d["fits"]:
            body.append((d["hosts"], d["devices_per_host"], d["world_size"], "does not fit", "", "", ""))
            continue
        imb = d["imbalance"] or {}
        body.append(
            (
                d["hosts"],
                d["devices_per_host"],
                d["world_size"],
                f"{(d['max_memory_bytes'] or 0) / _GB:.2f}",
                f"{d['step_ms']:.4g}" if d["step_ms"] is not None else "n/a",
                f"{d['samples_per_s']:,.0f}" if d["samples_per_s"] else "n/a",
                " / ".join("n/a" if imb.get(k) is None else f"{imb[k]:.2f}" for k in ("memory", "cost")),
            )
        )
    widths = [max(len(str(r[i])) for r in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(str(v).rjust(w) for v, w in zip(r, widths)).rstrip() for r in [header, *body])


def write_sweep_png(rows: Sequence[SweepRow], path: os.PathLike[str] | str) -> None:
    """Memory per rank and samples/s for each topology that fits, off-screen (Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fits = [r for r in rows if r.report is not None]
    fig = Figure(figsize=(6.0, 3.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = list(range(len(fits)))  # evenly spaced: topologies usually double
    mem = [(report.max_memory_bytes or 0) / _GB for r in fits if (report := r.report) is not None]  # all of fits
    ax.plot(xs, mem, "o-", color="tab:blue", label="memory per rank (GiB)")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{r.cluster.hosts}x{r.cluster.devices_per_host}" for r in fits])
    ax.set_xlabel("hosts x devices per host")
    ax.set_ylabel("memory per rank (GiB)")
    twin = ax.twinx()
    twin.plot(xs, [r.samples_per_s or 0 for r in fits], "s--", color="tab:orange", label="samples/s (planner)")
    twin.set_ylabel("samples/s (planner's step time)")
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [str(ln.get_label()) for ln in lines], loc="upper center", fontsize=8)
    missing = [r.cluster.describe() for r in rows if r.report is None]
    title = "Planned topologies" + (f" (does not fit: {', '.join(missing)})" if missing else "")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")


def build_on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    """``factory()`` with tensors created on ``meta`` unless it names a device: a 500 GB model's tables cost nothing.

    Example::

        model = build_on_meta(lambda: DLRMModule(sparse_features=features, num_dense_features=13))
    """
    with torch.device("meta"):
        return factory()


def presets_text() -> str:
    """The device presets as lines of text (for ``--help``)."""
    return "; ".join(
        f"{p.name}: {p.device_type}{f', {p.hbm_gb:g} GiB HBM' if p.hbm_gb else ''}, {p.ddr_gb:g} GiB DDR"
        for p in DEVICE_PRESETS.values()
    )


def sweep_clusters(hosts: Sequence[int], devices_per_host: Sequence[int], **device: Any) -> list[Cluster]:
    """Every hosts x devices-per-host combination, smallest world first."""
    clusters = [Cluster(h, d, **device) for h in hosts for d in devices_per_host]
    return sorted(clusters, key=lambda c: (c.world_size, c.hosts))
