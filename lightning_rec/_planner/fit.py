"""Why a model does not fit a topology, read from the planner's failure: the tables that do not fit and what they need
at their smallest, the ranks' usable memory, and the smallest of some bigger topologies that holds them
(:func:`does_not_fit`, which returns a :class:`DoesNotFit` to raise).

Example::

    try:
        report = plan_cluster(model, sharding, Cluster(1, 2, preset="a100-40g"))
    except DoesNotFit as err:
        err.needs            # {"item": 163_840_000_000, ...}: bytes per table at its smallest, largest first
        err.smallest_fit     # Cluster(hosts=4, devices_per_host=2, ...) or None
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn
from torchrec.distributed.planner.types import PlannerError

from lightning_rec import _compat
from lightning_rec._planner.cluster import Cluster
from lightning_rec._planner.constants import GIB, LARGEST_TABLES_NAMED, MAX_CANDIDATE_PLANS, MIB, STORAGE_RESERVATION
from lightning_rec._planner.planner import asking_the_sharders, planner_for, table_storage_options
from lightning_rec._planner.request import PlanRequest
from lightning_rec._planner.topology import DevicePreset
from lightning_rec.config import TopologyConfig

__all__ = ["DoesNotFit", "does_not_fit"]


class DoesNotFit(ValueError):
    """The tables do not fit the topology: which ones, how much they need, and what would hold them. Raised by
    :func:`lightning_rec.plan_cluster` (``lightning-rec plan`` prints it and exits 2).

    Args:
        message: the whole explanation.
        needs: each table's smallest memory over its sharding options, bytes, largest first.
        smallest_fit: the smallest candidate topology that planned, if any.

    Example::

        try:
            lightning_rec.plan_cluster(model, strategy.sharding, lightning_rec.Cluster(1, 2, preset="a100-40g"))
        except lightning_rec.DoesNotFit as err:
            print(err)                      # "... item (152.6 GiB in its smallest shard) does not fit ... HINT: ..."
            bigger = err.smallest_fit       # a Cluster that holds the tables, or None
    """

    def __init__(self, message: str, needs: dict[str, int], smallest_fit: Cluster | None) -> None:
        super().__init__(message)
        self.needs = needs
        self.smallest_fit = smallest_fit


def does_not_fit(
    module: nn.Module,
    request: PlanRequest,
    cluster: Cluster,
    plans: Callable[[Cluster], object],
    candidates: Sequence[Cluster] = (),
) -> DoesNotFit:
    """Explain why the planner found no plan for ``request`` (``module`` on ``cluster``).

    Args:
        module: the model the request's tables are from.
        request: what the planner was asked (its sharders, constraints, optimizer state and device).
        cluster: the topology it was asked for.
        plans: plans the same model on another cluster; raises ``PlannerError`` when it does not fit there.
        candidates: bigger topologies to try (default: :meth:`Cluster.bigger`); at most
            :data:`~lightning_rec._planner.constants.MAX_CANDIDATE_PLANS` are planned, smallest first, after those
            too small by arithmetic alone are left out.
    """
    needs, piece, usable = _smallest_needs(module, request)
    too_big = [t for t in needs if piece[t] > usable]
    total = sum(needs.values())
    if too_big:
        what = (
            f"{', '.join(f'{t} ({_gb(piece[t])} in its smallest shard)' for t in too_big)} "
            f"{'does' if len(too_big) == 1 else 'do'} not fit on any of these ranks ({_gb(usable)} usable per rank)"
        )
    else:
        largest = list(needs)[: max(1, min(LARGEST_TABLES_NAMED, len(needs)))]
        what = (
            f"the tables need {_gb(total)} in all, at their smallest (largest: "
            f"{', '.join(f'{t} {_gb(needs[t])}' for t in largest)}), and {cluster.world_size} rank(s) hold "
            f"{_gb(usable * cluster.world_size)} ({_gb(usable)} usable per rank)"
        )
    tried = list(candidates) or cluster.bigger()
    smallest, attempts = _smallest_that_plans(cluster, tried, total, request.topology, plans)
    hint = (
        f"the smallest of the topologies tried that holds them is {smallest.describe()} ({smallest.world_size} ranks)"
        if smallest is not None
        else f"none of the topologies tried ({', '.join(c.describe() for c in tried[: attempts or len(tried)])}) holds "
        "them either"
    )
    return DoesNotFit(
        f"The model does not fit {cluster.describe()} ({cluster.world_size} rank(s), "
        f"{_device_text(request.device, cluster)}): {what}. HINT: {hint}; or shrink the tables, or lower the batch "
        f"size (the planner assumed {request.batch} per rank).",
        needs,
        smallest,
    )


def _smallest_needs(module: nn.Module, request: PlanRequest) -> tuple[dict[str, int], dict[str, int], int]:
    """Each table's smallest total and smallest largest shard over its sharding options (bytes; the totals largest
    first), and what one rank holds after the planner's storage reservation."""
    planner = planner_for(request)
    with asking_the_sharders(request):
        options = table_storage_options(module, list(request.sharders), planner)
    rank = _compat.planner_topology(planner).devices[0].storage
    cap = rank.hbm + rank.ddr  # the planner may also spill to host memory (UVM caching) on CUDA
    needs, piece = {}, {}
    for table, opts in options.items():
        needs[table] = min(sum(s.storage.hbm + s.storage.ddr for s in o.shards) for o in opts)
        piece[table] = min(max(s.storage.hbm + s.storage.ddr for s in o.shards) for o in opts)
    return dict(sorted(needs.items(), key=lambda kv: -kv[1])), piece, int(cap * (1 - STORAGE_RESERVATION))


def _smallest_that_plans(
    cluster: Cluster,
    tried: Sequence[Cluster],
    total: int,
    topology: TopologyConfig | None,
    plans: Callable[[Cluster], object],
) -> tuple[Cluster | None, int]:
    """The smallest of ``tried`` (bigger than ``cluster``) that ``plans``, and how many were planned."""
    attempts = 0
    for candidate in sorted(tried, key=lambda c: c.world_size):
        if candidate.world_size <= cluster.world_size and candidate.device() == cluster.device():
            continue
        rank_cap = _rank_capacity(candidate, topology)
        if rank_cap is not None and rank_cap * candidate.world_size < total:
            continue  # cannot hold them by arithmetic alone: no need to ask the planner
        if attempts == MAX_CANDIDATE_PLANS:
            break
        attempts += 1
        try:
            plans(candidate)
        except PlannerError:
            continue
        return candidate, attempts
    return None, attempts


def _rank_capacity(cluster: Cluster, topology: TopologyConfig | None) -> int | None:
    """Usable bytes per rank of ``cluster`` after the planner's storage reservation, if its device says."""
    device = cluster.device(topology)
    if device is None:
        return None
    hbm = (
        (topology.hbm_cap if topology and topology.hbm_cap else (device.hbm_gb or 0) * GIB)
        if cluster.device_type == "cuda"
        else 0
    )
    ddr = topology.ddr_cap if topology and topology.ddr_cap else (device.ddr_gb or 0) * GIB
    return int((hbm + ddr) * (1 - STORAGE_RESERVATION)) or None


def _device_text(device: DevicePreset | None, cluster: Cluster) -> str:
    if device is None:
        return f"{cluster.device_type}, TorchRec's default memory"
    hbm = f"{device.hbm_gb:g} GiB HBM + " if device.hbm_gb else ""
    return f"{hbm}{device.ddr_gb:g} GiB DDR per rank" if device.ddr_gb is not None else f"{device.name}"


def _gb(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= 0.1 * GIB else f"{nbytes / MIB:,.1f} MiB"
