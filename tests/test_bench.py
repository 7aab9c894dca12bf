"""`python -m lightning_rec.bench`: runs end to end (tiny size), checks raw vs recshard, prints the JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lightning_rec.bench import check_identical, final_record, main, plot_batch_sweep
from lightning_rec.bench.runner import _free_port
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


def _values(ms, rss, batch=4096):
    return {"ms_per_step": [ms], "samples_per_s": [1000 * batch / ms], "peak_rss_mb": [rss]}


def test_final_record_ratios_and_the_size_where_tables_dominate():
    results = {
        "tiny": {"raw": _values(1.5, 400, 64), "recshard": _values(1.9, 400, 64)},
        "realistic": {"raw": _values(40, 900), "recshard": _values(44, 918), "lightning_ddp": _values(160, 1260)},
    }
    final = final_record(results, repeats=1)
    assert final["overhead_ms"] == 0.4
    assert final["recshard_vs_raw"] == round(40 / 44, 4) and final["rss_recshard_vs_raw"] == 1.02
    assert final["tables_dominate_size"] == "realistic" and final["rss_recshard_vs_lightning_ddp"] == round(918 / 1260, 4)
    results["large"] = {"recshard": _values(50, 2400), "lightning_ddp": _values(600, 4800)}
    final = final_record(results, repeats=1)
    assert final["tables_dominate_size"] == "large"
    assert final["recshard_vs_lightning_ddp"] == 12.0 and final["rss_recshard_vs_lightning_ddp"] == 0.5
    assert final["recshard_vs_raw_2proc"] is None  # not measured: None, never a made-up number


def test_plot_batch_sweep_writes_a_png(tmp_path):
    results = {f"realistic@{b}": {"raw": _values(b / 100, 900, b), "recshard": _values(b / 95, 910, b)} for b in (512, 1024, 2048)}
    results["tiny"] = {"raw": _values(1.5, 400, 64)}  # not a sweep: left out of the plot
    path = tmp_path / "sweep.png"
    plot_batch_sweep(results, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_bench_refuses_unknown_names_and_a_plot_without_a_sweep(capsys):
    with pytest.raises(SystemExit):
        main(["--sizes", "huge"])
    assert "unknown variant/size ['huge']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--plot", "x.png"])
    assert "give --batch-sizes" in capsys.readouterr().err


def test_profile_step_times_the_phases_and_lightnings_hooks():
    out = subprocess.run(
        [sys.executable, "benchmarks/profile_step.py", "recshard", "--size", "tiny", "--steps", "30", "--hooks"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "MASTER_PORT": str(_free_port())},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])
    phases = record["phases_ms"]
    assert phases["forward"] > 0 and phases["backward"] > 0 and phases["rest"] > 0
    assert phases["cycle"] >= phases["forward"] + phases["backward"]
    assert "on_before_optimizer_step -> on_train_batch_end" in record["timeline_ms"]
    assert record["ops_ms"] and record["all_ops_ms"] >= max(record["ops_ms"].values()) > 0
