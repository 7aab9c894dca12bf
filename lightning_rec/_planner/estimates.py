"""The planner's estimates per rank, and how even they are.

- :class:`RankEstimate`: one rank's totals, summed over the table shards placed on it (as TorchRec's own
  ``EmbeddingStats`` does; :func:`rank_estimates`): memory in bytes, HBM (device) and DDR (host; what CPU training
  uses), and cost, ``Perf.total``: the modelled milliseconds per step of those shards' lookups and communication,
  split into lookups, the input all-to-all (not part of ``Perf.total``) and the output all-to-all; their sum is
  ``step_ms``. Dense layers are not included.
- :func:`imbalance`: ``max / mean`` over ranks. 1.0 is perfectly even; on ``N`` ranks it is at most ``N`` (one rank
  carries everything).

The report that carries them: :mod:`lightning_rec._planner.report`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["RankEstimate", "all_known", "imbalance", "rank_estimates"]


@dataclass
class RankEstimate:
    """The planner's totals for one rank (``None``: no estimate).

    Args:
        rank: the global rank.
        hbm_bytes: device memory of the table shards placed there.
        ddr_bytes: host memory of the table shards placed there.
        cost: modelled milliseconds per step (``Perf.total``, what the planner balances) of those shards.
        lookup_ms: of ``cost``, the lookups' forward and backward (``fwd_compute + bwd_compute + prefetch_compute``).
        input_dist_ms: the ids' input all-to-all (``Perf.input_dist_comms``; not part of ``cost``).
        output_dist_ms: of ``cost``, the embeddings' output all-to-all and its gradient's
            (``fwd_comms + bwd_comms``).

    Example::

        >>> RankEstimate(rank=0, hbm_bytes=0, ddr_bytes=4096, cost=0.2).memory_bytes
        4096
        >>> RankEstimate(0, lookup_ms=1.0, input_dist_ms=0.5, output_dist_ms=2.0).step_ms
        3.5
    """

    rank: int
    hbm_bytes: int | None = None
    ddr_bytes: int | None = None
    cost: float | None = None
    lookup_ms: float | None = None
    input_dist_ms: float | None = None
    output_dist_ms: float | None = None

    @property
    def step_ms(self) -> float | None:
        """The planner's milliseconds per step of this rank's tables: lookups, input and output all-to-alls."""
        parts = all_known((self.lookup_ms, self.input_dist_ms, self.output_dist_ms))
        return None if parts is None else sum(parts)

    @property
    def memory_bytes(self) -> int | None:
        """HBM plus DDR bytes, or ``None`` without an estimate."""
        if self.hbm_bytes is None or self.ddr_bytes is None:
            return None
        return self.hbm_bytes + self.ddr_bytes

    def to_dict(self) -> dict[str, Any]:
        """``{"rank", "hbm_bytes", "ddr_bytes", "memory_bytes", "cost", "lookup_ms", "input_dist_ms",
        "output_dist_ms", "step_ms"}``."""
        return {
            "rank": self.rank,
            "hbm_bytes": self.hbm_bytes,
            "ddr_bytes": self.ddr_bytes,
            "memory_bytes": self.memory_bytes,
            "cost": self.cost,
            "lookup_ms": self.lookup_ms,
            "input_dist_ms": self.input_dist_ms,
            "output_dist_ms": self.output_dist_ms,
            "step_ms": self.step_ms,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> RankEstimate:
        """The inverse of :meth:`to_dict` (derived keys are ignored)."""
        keys = ("hbm_bytes", "ddr_bytes", "cost", "lookup_ms", "input_dist_ms", "output_dist_ms")
        return cls(int(doc["rank"]), **{k: doc.get(k) for k in keys})


def imbalance(values: Sequence[float | None]) -> float | None:
    """``max / mean`` of per-rank ``values``: 1.0 is even, ``len(values)`` is one rank carrying everything.

    Returns:
        ``None`` if any value is missing or the mean is not positive.

    Example::

        >>> imbalance([3.0, 1.0])
        1.5
        >>> imbalance([2.0, 2.0]), imbalance([None, 1.0]), imbalance([0, 0])
        (1.0, None, None)
    """
    known = all_known(values)
    if not known:
        return None
    mean = sum(known) / len(known)
    return max(known) / mean if mean > 0 else None


_T = TypeVar("_T")


def all_known(values: Sequence[_T | None]) -> list[_T] | None:
    """``values`` as a list, or ``None`` if any of them is ``None``."""
    known = [v for v in values if v is not None]
    return known if len(known) == len(values) else None


def rank_estimates(sharding_options: Sequence[Any], world_size: int) -> list[RankEstimate]:
    """The planner's chosen ``ShardingOption``\\ s summed per rank (shards without a rank in ``[0, world_size)``
    are left out).

    Args:
        sharding_options: the planner's chosen options, whose shards carry ``rank``, ``storage`` and ``perf`` (see
            ``lightning_rec._compat.planner_sharding_options``).
        world_size: number of ranks.
    """
    ranks = [RankEstimate(r, 0, 0, 0.0, 0.0, 0.0, 0.0) for r in range(world_size)]
    for option in sharding_options:
        for shard in option.shards:
            if shard.rank is None or not 0 <= shard.rank < world_size:
                continue
            total = ranks[shard.rank]
            if shard.storage is not None:
                total.hbm_bytes += int(shard.storage.hbm)
                total.ddr_bytes += int(shard.storage.ddr)
            if shard.perf is not None:
                perf = shard.perf
                total.cost += float(perf.total)
                total.lookup_ms += float(perf.fwd_compute + perf.bwd_compute + perf.prefetch_compute)
                total.input_dist_ms += float(getattr(perf, "input_dist_comms", 0.0))
                total.output_dist_ms += float(perf.fwd_comms + perf.bwd_comms)
    return ranks
