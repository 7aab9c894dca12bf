"""lightning_rec._planner.estimates: the planner's estimates summed per rank, and how even they are."""

from __future__ import annotations

from types import SimpleNamespace

from lightning_rec._planner.estimates import RankEstimate, imbalance, rank_estimates


def _shard(rank: int | None, ddr: int, total: float) -> SimpleNamespace:
    perf = SimpleNamespace(total=total, fwd_compute=total / 2, bwd_compute=total / 4, prefetch_compute=0.0,
                           fwd_comms=total / 8, bwd_comms=total / 8, input_dist_comms=0.5)  # fmt: skip
    return SimpleNamespace(rank=rank, storage=SimpleNamespace(hbm=0, ddr=ddr), perf=perf)


def test_shards_are_summed_on_their_ranks_and_others_left_out() -> None:
    options = [
        SimpleNamespace(shards=[_shard(0, 100, 2.0), _shard(1, 300, 4.0), _shard(None, 7, 1.0), _shard(5, 7, 1.0)])
    ]
    zero, one = rank_estimates(options, world_size=2)
    assert (zero.memory_bytes, one.memory_bytes, zero.cost, one.cost) == (100, 300, 2.0, 4.0)
    assert one.step_ms == 3.0 + 1.0 + 0.5, "lookups, output and input all-to-alls"
    assert RankEstimate.from_dict(one.to_dict()) == one


def test_imbalance_is_max_over_mean_and_unknown_without_every_rank() -> None:
    assert imbalance([100, 300]) == 1.5 and imbalance([1, None]) is None and imbalance([0, 0]) is None
