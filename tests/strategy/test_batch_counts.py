"""Ranks that run different numbers of training batches are named, not hung (torchrec#189): with a sized loader
before the first batch, with a bare iterable after the shorter rank's last step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import batch_count_scenarios
from tests.helpers.dist import run_ranks


@pytest.mark.dist
def test_an_iterable_that_gives_rank_1_fewer_batches_stops_both_ranks_naming_it(tmp_path: Path) -> None:
    res = run_ranks(batch_count_scenarios.uneven, 2, tmp_path, counts=[5, 4], sized=False)
    short, long = res[1], res[0]
    assert short["error"].startswith("UnequalBatchesError: RecShardStrategy: the ranks ran different numbers")
    assert "rank 1 after 4 batches ran out; rank(s) 0 had not run out" in short["error"]
    assert "HINT: give every rank the same number of batches" in short["error"]
    assert short["batches"] == 4, "stopped after its last batch, before pairing anything with rank 0's 5th"
    assert "Rank 1 stopped here after its 4 batches" in short["error"]
    assert long["error"] is not None and "rank 1" in long["error"], "rank 0 is told why it stopped"
    assert max(r["seconds"] for r in res) < 45, "named within seconds, not after the 60 s collective timeout"


@pytest.mark.dist
def test_sized_loaders_of_different_lengths_are_refused_before_the_first_batch_equal_ones_train(
    tmp_path: Path,
) -> None:
    res = run_ranks(batch_count_scenarios.equal_then_sized, 2, tmp_path)
    assert [(r["equal"]["error"], r["equal"]["batches"]) for r in res] == [(None, 12), (None, 12)], "no false alarm"
    for r in res:
        assert (
            "the ranks' training loaders have different lengths: rank 0: 5 batches, rank 1: 4 batches"
            in (r["sized"]["error"])
        )
        assert r["sized"]["batches"] == 0
