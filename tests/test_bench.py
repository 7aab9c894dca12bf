"""`python -m lightning_rec.bench`: runs end to end (tiny size), checks raw vs recshard, prints the JSON line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_rec.bench import check_identical
from tests.helpers.dist import REPO


def test_bench_tiny_runs_and_reports_the_ratios():
    out = subprocess.run(
        [sys.executable, "-m", "lightning_rec.bench", "--quick", "--sizes", "tiny", "--repeats", "1", "--variants", "raw,recshard"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "tiny: raw and recshard trained identically (losses, plan, kernels)" in out.stdout
    final = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("recshard_vs_raw", "pipelined_vs_raw_pipeline", "overhead_ms", "recshard_vs_raw_2proc",
                "recshard_vs_lightning_ddp", "rss_recshard_vs_raw", "rss_recshard_vs_lightning_ddp"):
        assert key in final
    assert isinstance(final["overhead_ms"], float)


def test_check_identical_refuses_different_training():
    record = {"plan": {"t_f0": ["table_wise", "fused", [0]]}, "losses": [0.7, 0.6]}
    check_identical([record], [dict(record)])
    with pytest.raises(AssertionError, match="per-step losses differ"):
        check_identical([record], [{**record, "losses": [0.7, 0.61]}])
    with pytest.raises(AssertionError, match="plans differ"):
        check_identical([record], [{**record, "plan": {"t_f0": ["column_wise", "fused", [0]]}}])
