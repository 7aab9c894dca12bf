"""`python -m lightning_rec.testing.bench`: runs end to end (tiny size, the GPU sizes shrunk on CPU, the real ones on a GPU),
checks raw vs recshard, prints the JSON line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from lightning_rec.testing.bench import SIZES, check_identical, final_record, fused_params, main, plot_batch_sweep
from lightning_rec.testing.bench.workload import make_batches
from lightning_rec.testing.ports import free_port
from tests.helpers.dist import REPO


def _bench(*args: str, timeout: float = 300, script: str = "-m lightning_rec.testing.bench"):
    """Run the bench (or a ``benchmarks/`` script) from the repository; its output and its last line's JSON."""
    out = subprocess.run(
        [sys.executable, *script.split(), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "MASTER_PORT": str(free_port())},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout, json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.dist
def test_bench_tiny_runs_and_reports_the_ratios():
    stdout, final = _bench("--quick", "--sizes", "tiny", "--repeats", "1", "--variants", "raw,recshard")
    assert "tiny: raw and recshard trained identically (losses, plan, kernels)" in stdout
    for key in (
        "recshard_vs_raw",
        "pipelined_vs_raw_pipeline",
        "overhead_ms",
        "recshard_vs_raw_2proc",
        "recshard_vs_lightning_ddp",
        "rss_recshard_vs_raw",
        "rss_recshard_vs_lightning_ddp",
        "recshard_vs_lightning_sparse",
        "rss_recshard_vs_lightning_sparse",
        "recshard_vs_raw_criteo_onehot",
    ):
        assert key in final
    assert isinstance(final["overhead_ms"], float)
    assert final["optimizer"] == "sgd" and final["measured"]["tiny"]["rows"] == SIZES["tiny"].rows


def _check_bandwidth(final, label, variants):
    """The embedding bandwidth is the documented model, recomputed from the JSON's own numbers."""
    size = final["measured"][label]
    ids = size["tables"] * size["batch_size"] * size["pooling"]
    for variant in variants:
        row = final["by_size"][label][variant]
        assert row["emb_gb_s"] == pytest.approx(ids * size["dim"] * 4 * 3 / (row["ms_per_step"] / 1000) / 1e9, rel=1e-3)
        assert row["copy_gb_s"] > 0 and math.isfinite(row["copy_gb_s"])
        assert row["emb_bw_frac"] == pytest.approx(row["emb_gb_s"] / row["copy_gb_s"], rel=1e-3)
        assert 0 < row["emb_bw_frac"] and math.isfinite(row["emb_bw_frac"])  # CPU caches can take it above 1


@pytest.mark.dist
def test_bench_gpu_size_shrunk_on_cpu_reports_both_plain_lightning_peers():
    variants = ["raw", "recshard", "lightning_sparse", "lightning_ddp"]
    stdout, final = _bench(
        "--sizes",
        "criteo_multihot",
        "--rows",
        "1000",
        "--batch-sizes",
        "128",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--repeats",
        "1",
        "--optimizer",
        "adagrad",
        "--variants",
        ",".join(variants),
    )
    # Adagrad: FBGEMM's EXACT_ADAGRAD in the hand-written loop, derived from torch.optim.Adagrad by recshard.
    assert "criteo_multihot: raw and recshard trained identically (losses, plan, kernels)" in stdout
    assert final["measured"]["criteo_multihot"] == {
        "tables": 26,
        "rows": 1000,
        "dim": 128,
        "batch_size": 128,
        "pooling": 20,
        "world_size": 1,
        "steps": 4,
        "warmup": 2,
        "sharding": "table_wise",
        "dense": 13,
        "distinct_batches": 4,
        "optimizer": "adagrad",
    }
    for peer in ("raw", "lightning_sparse", "lightning_ddp"):
        ratio = final[f"recshard_vs_{peer}_criteo_multihot"]
        assert isinstance(ratio, float) and ratio > 0
    assert final["pipelined_vs_raw_pipeline_criteo_multihot"] is None  # not measured
    assert final["recshard_vs_raw_criteo_onehot"] is None and final["recshard_vs_lightning_sparse"] is None
    assert sorted(final["by_size"]["criteo_multihot"]) == sorted(variants)
    _check_bandwidth(final, "criteo_multihot", variants)
    assert "emb/copy" in stdout


@pytest.mark.dist
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and the CUDA build of FBGEMM")
def test_bench_criteo_onehot_on_a_gpu():
    stdout, final = _bench(
        "--sizes",
        "criteo_onehot",
        "--variants",
        "raw,recshard",
        "--repeats",
        "1",
        "--steps",
        "5",
        "--warmup",
        "2",
        "--optimizer",
        "adagrad",
        timeout=900,
    )
    assert "criteo_onehot: raw and recshard trained identically (losses, plan, kernels)" in stdout
    assert final["device"] == "cuda" and isinstance(final["recshard_vs_raw_criteo_onehot"], float)
    assert final["measured"]["criteo_onehot"]["rows"] == 1_000_000
    _check_bandwidth(final, "criteo_onehot", ["raw", "recshard"])
    for variant in ("raw", "recshard"):  # 13 GB of tables: no cache holds them
        assert final["by_size"]["criteo_onehot"][variant]["emb_bw_frac"] < 1
        assert final["by_size"]["criteo_onehot"][variant]["peak_device_mem_mb"] > 13e9 / 2**20


def test_raw_loops_fused_optimizer_is_what_recshard_derives_from_the_torch_one():
    from lightning_rec._strategy.optim import embedding_optimizer_from_torch

    for name, opt in (("sgd", torch.optim.SGD), ("adagrad", torch.optim.Adagrad)):
        torch_opt = opt([torch.nn.Parameter(torch.zeros(2))], lr=0.03)
        derived = embedding_optimizer_from_torch(torch_opt, torch_opt.param_groups[0]).to_fused_params()
        ours = fused_params(name, 0.03)
        assert {k: derived[k] for k in ours} == ours


def test_gpu_sizes_cycle_a_few_distinct_batches_and_the_others_do_not():
    small = replace(SIZES["criteo_multihot"], rows=50, batch_size=8)
    batches = make_batches(small, rank=0, n=10)
    assert len(batches) == 10 and len({id(b) for b in batches}) == 4 and batches[5] is batches[1]
    assert batches[0].dense_features.shape == (8, 13) and batches[0].sparse_features.values().numel() == 26 * 8 * 20
    tiny = make_batches(SIZES["tiny"], rank=0, n=10)
    assert len({id(b) for b in tiny}) == 10 and tiny[0].dense_features.shape == (64, 4)


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
    assert final["tables_dominate_size"] == "realistic" and final["rss_recshard_vs_lightning_ddp"] == round(
        918 / 1260, 4
    )
    results["large"] = {"recshard": _values(50, 2400), "lightning_ddp": _values(600, 4800)}
    final = final_record(results, repeats=1)
    assert final["tables_dominate_size"] == "large"
    assert final["recshard_vs_lightning_ddp"] == 12.0 and final["rss_recshard_vs_lightning_ddp"] == 0.5
    assert final["recshard_vs_raw_2proc"] is None  # not measured: None, never a made-up number
    assert final["recshard_vs_lightning_sparse"] is None and final["sparse_peer_size"] == "realistic"


def _bw(values, emb_gb_s, copy_gb_s):
    return {**values, "emb_gb_s": [emb_gb_s], "copy_gb_s": [copy_gb_s], "emb_bw_frac": [emb_gb_s / copy_gb_s]}


def test_final_record_both_plain_lightning_peers_and_the_gpu_sizes():
    results = {
        "realistic": {"recshard": _values(44, 918), "lightning_sparse": _values(66, 1000)},
        "large": {"recshard": _values(50, 2400), "lightning_ddp": _values(600, 4800)},
        "criteo_multihot": {
            "raw": _bw(_values(40, 900, 16384), 600.0, 3000.0),
            "recshard": _bw(_values(42, 910, 16384), 570.0, 3000.0),
            "lightning_sparse": _values(80, 950, 16384),
            "lightning_ddp": _values(400, 990, 16384),
            "raw_pipeline": _values(35, 900, 16384),
            "recshard_pipelined": _values(36, 900, 16384),
        },
        "criteo_onehot": {"raw": _values(10, 900, 16384)},
    }
    final = final_record(results, repeats=1)
    # Each peer where it was measured: the dense-gradient one at large, the sparse one at realistic.
    assert final["tables_dominate_size"] == "large" and final["recshard_vs_lightning_ddp"] == 12.0
    assert final["sparse_peer_size"] == "realistic" and final["recshard_vs_lightning_sparse"] == 1.5
    assert final["rss_recshard_vs_lightning_sparse"] == 0.918
    # ... and per CPU size, where measured.
    assert final["recshard_vs_lightning_sparse_realistic"] == 1.5
    assert final["recshard_vs_lightning_sparse_large"] is None
    assert final["recshard_vs_raw_criteo_multihot"] == round(40 / 42, 4)
    assert final["recshard_vs_lightning_sparse_criteo_multihot"] == round(80 / 42, 4)
    assert final["recshard_vs_lightning_ddp_criteo_multihot"] == round(400 / 42, 4)
    assert final["pipelined_vs_raw_pipeline_criteo_multihot"] == round(35 / 36, 4)
    assert final["pipelined_vs_lightning_sparse_criteo_multihot"] == round(80 / 36, 4)
    assert final["recshard_vs_raw_criteo_onehot"] is None  # recshard not measured there
    by_size = final["by_size"]["criteo_multihot"]
    assert by_size["recshard"]["emb_bw_frac"] == 0.19 and by_size["recshard"]["ms_per_step"] == 42
    assert "emb_bw_frac" not in by_size["lightning_sparse"]  # not measured: left out, not made up


def test_plot_batch_sweep_writes_a_png(tmp_path):
    results = {
        f"realistic@{b}": {"raw": _values(b / 100, 900, b), "recshard": _values(b / 95, 910, b)}
        for b in (512, 1024, 2048)
    }
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
    with pytest.raises(SystemExit):
        main(["--plot", "x.png", "--batch-sizes", "512"])
    assert "two values or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--sharding", "diagonal"])
    assert "invalid choice: 'diagonal'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--optimizer", "adam"])
    assert "invalid choice: 'adam'" in capsys.readouterr().err


@pytest.mark.dist
@pytest.mark.skipif(torch.cuda.is_available(), reason="for machines without a GPU")
def test_bench_without_a_gpu_runs_the_gpu_sizes_with_fewer_rows_and_row_wise(capsys):
    final = main(
        ["--sizes", "tiny", "--variants", "raw,recshard", "--sharding", "row_wise", "--repeats", "1", "--steps", "3"]
    )
    assert final["measured"]["tiny"]["sharding"] == "row_wise" and set(final["by_size"]["tiny"]) == {"raw", "recshard"}
    assert "tiny: raw and recshard trained identically (losses, plan, kernels)" in capsys.readouterr().out
    final = main(
        [
            "--sizes",
            "criteo_onehot",
            "--variants",
            "raw",
            "--repeats",
            "1",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--batch-sizes",
            "64",
        ]
    )
    out = capsys.readouterr().out
    assert "criteo_onehot is GPU-sized" in out and "13.3 GB" in out and "100,000 rows per table" in out
    assert final["measured"]["criteo_onehot"]["rows"] == 100_000 and final["measured"]["criteo_onehot"]["tables"] == 26


@pytest.mark.dist
def test_profile_step_times_the_phases_and_lightnings_hooks():
    _, record = _bench("recshard", "--size", "tiny", "--steps", "30", "--hooks", script="benchmarks/profile_step.py")
    phases = record["phases_ms"]
    assert phases["forward"] > 0 and phases["backward"] > 0 and phases["rest"] > 0
    assert phases["cycle"] >= phases["forward"] + phases["backward"]
    assert "on_before_optimizer_step -> on_train_batch_end" in record["timeline_ms"]
    assert record["ops_ms"] and record["all_ops_ms"] >= max(record["ops_ms"].values()) > 0


def test_lightnings_own_overhead_and_recshards_beyond_it():
    results = {
        "tiny": {
            "raw": _values(1.3, 400, 64),
            "recshard": _values(1.7, 400, 64),
            "plain_sparse": _values(1.0, 400, 64),
            "lightning_sparse": _values(1.25, 400, 64),
        }
    }
    final = final_record(results, repeats=1)
    assert final["lightning_overhead_ms"] == 0.25
    assert final["recshard_overhead_beyond_lightnings_ms"] == 0.15  # 0.4 over raw, 0.25 of it Lightning's
    del results["tiny"]["plain_sparse"]
    assert final_record(results, repeats=1)["recshard_overhead_beyond_lightnings_ms"] is None


@pytest.mark.dist
def test_paired_overhead_pairs_each_lightning_step_with_its_baseline():
    _, record = _bench("--size", "tiny", "--steps", "20", script="benchmarks/paired_overhead.py")
    for name in ("recshard", "lightning"):
        assert 0 < record[f"{name}_baseline_ms"] and 0 < record[f"{name}_ms"]
    assert record["overhead_ms"] == round(record["recshard_ms"] - record["recshard_baseline_ms"], 4)
    assert record["recshard_overhead_beyond_lightnings_ms"] == round(
        record["overhead_ms"] - record["lightning_overhead_ms"], 4
    )
