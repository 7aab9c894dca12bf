"""The two-tower retrieval model (issue 15): leave-one-out data, ranking metrics, the gathered in-batch softmax,
exactness on 2 ranks, towers used alone, the shipped config."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.zoo import check_case


def test_trains_like_plain_pytorch_pipelined_and_resharded(tmp_path: Path) -> None:
    check_case(tmp_path, "tests.helpers.zoo_two_tower:CASE")
