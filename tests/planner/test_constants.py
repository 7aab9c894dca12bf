"""lightning_rec._planner.constants: each number is named once and is the one the planner and its explanations use."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_rec
from lightning_rec._planner import constants
from lightning_rec._planner.cluster import Cluster
from lightning_rec._planner.fit import _rank_capacity

PACKAGE = Path(lightning_rec.__file__).parent


def test_the_storage_reservation_is_written_once_and_the_explanation_counts_it() -> None:
    written = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "constants.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in (0.15, 0.85)
    ]
    assert not written, f"the reservation restated: {written}"
    usable = _rank_capacity(Cluster(1, 1, preset="a100-40g", ddr_gb=0), None)
    assert usable == int(40 * constants.GIB * (1 - constants.STORAGE_RESERVATION))


def test_the_default_batch_is_torchrecs_and_the_candidates_grow() -> None:
    from torchrec.distributed.planner.constants import BATCH_SIZE

    assert constants.DEFAULT_BATCH_SIZE == BATCH_SIZE
    assert list(constants.CANDIDATE_SCALES) == sorted(constants.CANDIDATE_SCALES) and constants.CANDIDATE_SCALES[0] > 1
    assert constants.MAX_CANDIDATE_PLANS >= 1 and constants.LARGEST_TABLES_NAMED >= 1
    assert [c.hosts for c in Cluster(3, 2).bigger()] == [3 * k for k in constants.CANDIDATE_SCALES]
