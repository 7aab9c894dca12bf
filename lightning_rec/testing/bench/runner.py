"""The orchestrator: fresh processes per (variant, size, repeat), the identity check, the ratios, the plot."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, replace
from typing import Any

from lightning_rec.testing.bench.worker import RESULT_PREFIX, run_worker
from lightning_rec.testing.bench.workload import EXTRA_VARIANTS, GPU_SIZES, OPTIMIZERS, SIZES, VARIANTS, Size
from lightning_rec.testing.ports import free_port

__all__ = [
    "check_identical",
    "final_record",
    "main",
    "measure",
    "plot_batch_sweep",
    "reexec_with_steady_malloc",
    "run_variant",
]

# Sharding types the bench can ask of every table (all on the fused kernel; every one runs on CPU too).
SHARDINGS = ("table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise")


# glibc's default heap trimming is adaptive: whether a process hands ~10 MB back to the OS and page-faults it in
# again every step depends on the order of its allocations, so two equivalent loops can differ by several percent
# for that reason alone (see BENCHMARKS.md: page faults per step). "steady" keeps freed memory in the heap, the
# same for every variant, so that ratios measure the code; "default" leaves glibc as it is. Variables the user
# already set win.
MALLOC_SETTINGS = {
    "steady": {
        "MALLOC_TRIM_THRESHOLD_": str(512 << 20),
        "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
        "MALLOC_TOP_PAD_": str(64 << 20),
    },
    "default": {},
}


def reexec_with_steady_malloc() -> None:
    """Re-run this script (``sys.argv``) under the ``steady`` malloc settings unless they are set (a variable the user
    set wins): for the benchmark scripts that time several variants in one process, where otherwise the one that
    follows another pays page faults for memory the other just handed back."""
    import sys

    steady = MALLOC_SETTINGS["steady"]
    if any(k not in os.environ for k in steady):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**steady, **os.environ})


def run_variant(
    variant: str, size: Size, lr: float = 0.01, timeout: float = 600, malloc: str = "steady"
) -> list[dict[str, Any]]:
    """Run ``variant`` at ``size`` on ``size.world_size`` fresh processes; every rank's record.

    Args:
        malloc: ``"steady"`` (glibc keeps freed memory: no per-step page faults, in every variant) or
            ``"default"`` (glibc as configured); see :data:`MALLOC_SETTINGS`.
    """
    port, procs = free_port(), []
    for rank in range(size.world_size):
        # Every variant gets the thread count Lightning's launcher would pick (cores / processes): two processes
        # with a full set of threads each would fight over the cores, more in some variants than in others.
        threads = str(max(1, (os.cpu_count() or 1) // size.world_size))
        env = {
            **MALLOC_SETTINGS[malloc],
            "OMP_NUM_THREADS": threads,
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(size.world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(size.world_size),
            "NODE_RANK": "0",
            "PYTHONWARNINGS": "ignore",
        }
        cmd = [
            sys.executable,
            "-m",
            "lightning_rec.testing.bench",
            "--worker",
            variant,
            "--size-json",
            json.dumps(asdict(size)),
            "--lr",
            str(lr),
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    records, logs = [], []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        logs.append(out)
        records += [
            json.loads(line[len(RESULT_PREFIX) :]) for line in out.splitlines() if line.startswith(RESULT_PREFIX)
        ]
    if any(p.returncode for p in procs) or len(records) != size.world_size:
        raise RuntimeError(f"bench variant {variant} at {size.name} failed:\n" + "\n".join(log[-3000:] for log in logs))
    return sorted(records, key=lambda r: r["rank"])


def _summary(records: list[dict[str, Any]], size: Size) -> dict[str, float]:
    ms = max(r["ms_per_step"] for r in records)  # ranks step together; the slowest sets the pace
    out = {
        "ms_per_step": ms,
        "samples_per_s": 1000 * size.batch_size * size.world_size / ms,
        "peak_rss_mb": max(r["peak_rss_bytes"] for r in records) / 2**20,
        "page_faults_per_step": max(r["page_faults_per_step"] for r in records),
    }
    if all(r.get("copy_gb_s") for r in records):
        # The bandwidth model of lightning_rec.testing.bench.worker, at the pace of the slowest rank, over the slowest
        # copy bandwidth: per rank, as every rank moves its own share of the rows.
        out["emb_gb_s"] = records[0]["emb_bytes_per_step"] / (ms / 1000) / 1e9
        out["copy_gb_s"] = min(r["copy_gb_s"] for r in records)
        out["emb_bw_frac"] = out["emb_gb_s"] / out["copy_gb_s"]
    if all(r.get("peak_device_mem_bytes") is not None for r in records):
        out["peak_device_mem_mb"] = max(r["peak_device_mem_bytes"] for r in records) / 2**20
    return out


def check_identical(a: list[dict[str, Any]], c: list[dict[str, Any]], atol: float = 1e-5) -> None:
    """Raise unless ``raw`` and ``recshard`` trained identically: same plan and kernels, same per-step losses."""
    for ra, rc in zip(a, c):
        if ra["plan"] != rc["plan"]:
            raise AssertionError(f"plans differ: raw {ra['plan']} vs recshard {rc['plan']}")
        diffs = [abs(x - y) for x, y in zip(ra["losses"], rc["losses"])]
        if len(ra["losses"]) != len(rc["losses"]) or max(diffs) > atol:
            raise AssertionError(
                f"per-step losses differ (max {max(diffs):.2e}): raw {ra['losses'][:5]} vs recshard {rc['losses'][:5]}"
            )


def _ratio(results, size: str, num: str, den: str, key: str = "samples_per_s") -> float | None:
    try:
        return round(statistics.median(results[size][num][key]) / statistics.median(results[size][den][key]), 4)
    except (KeyError, statistics.StatisticsError, ZeroDivisionError):
        return None


# Rows per table of a GPU size run without a GPU (unless --rows or --allow-cpu): 1.3 GB of tables instead of 13.
CPU_ROWS = 100_000


def _difference(results, size: str, a: str, b: str) -> float | None:
    """Median ms/step of ``a`` minus ``b`` at ``size`` (``None`` unless both were measured)."""
    try:
        return round(
            statistics.median(results[size][a]["ms_per_step"]) - statistics.median(results[size][b]["ms_per_step"]), 4
        )
    except (KeyError, statistics.StatisticsError):
        return None


def _beyond(results) -> float | None:
    """recshard's overhead over raw TorchRec at ``tiny`` minus Lightning's own over a plain loop (issue 14's GPU
    target: <= 0.3 ms)."""
    ours, lightnings = (
        _difference(results, "tiny", "recshard", "raw"),
        _difference(results, "tiny", "lightning_sparse", "plain_sparse"),
    )
    return None if ours is None or lightnings is None else round(ours - lightnings, 4)


Results = dict[str, dict[str, dict[str, list[float]]]]  # size label -> variant -> metric -> one value per repeat


def measure(
    size: Size, variants: list[str], repeats: int, lr: float = 0.01, malloc: str = "steady"
) -> dict[str, dict[str, list[float]]]:
    """Run every variant ``repeats`` times at ``size`` (order rotating), check that ``raw``, ``recshard`` and
    ``recshard_pipelined`` trained identically, and return variant -> metric -> values."""
    per_variant: dict[str, dict[str, list[float]]] = {}
    first: dict[str, list[dict[str, Any]]] = {}
    for rep in range(repeats):
        order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
        for variant in order:
            records = run_variant(variant, size, lr, malloc=malloc)
            first.setdefault(variant, records)
            for key, value in _summary(records, size).items():
                per_variant.setdefault(variant, {}).setdefault(key, []).append(value)
            print(
                f"{size.name:16s} b{size.batch_size:<6d} rep {rep} {variant:18s} {records[0]['ms_per_step']:9.2f} ms/step "
                f"{records[0]['page_faults_per_step']:8.0f} page faults/step {records[0]['emb_bw_frac']:8.4f} of copy bandwidth",
                flush=True,
            )
    for other in ("recshard", "recshard_pipelined", "recshard_unchecked", "recshard_strict"):
        if "raw" in first and other in first:
            check_identical(first["raw"], first[other])
            print(f"{size.name}: raw and {other} trained identically (losses, plan, kernels)", flush=True)
    return per_variant


def _peer_size(results: Results, peer: str) -> str:
    """Where recshard meets a plain-Lightning peer on CPU: ``large`` (tables dominate memory) when the peer ran
    there, else ``realistic``."""
    return "large" if peer in results.get("large", {}) else "realistic"


def _medians(per_variant: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    return {
        variant: {key: round(statistics.median(values), 6) for key, values in metrics.items() if values}
        for variant, metrics in per_variant.items()
    }


def final_record(results: Results, repeats: int) -> dict[str, Any]:
    """The ratios the issue asks for (medians over repeats; samples/s unless named ``rss_``), and ``by_size``: every
    measured label's medians per variant (ms/step, samples/s, peak RSS, embedding bandwidth and its fraction of
    the copy bandwidth, peak device memory on CUDA).

    Against plain Lightning the comparisons use ``large`` (tables dominate memory) when the peer was measured
    there, else ``realistic``: ``tables_dominate_size`` says which for the dense-gradient peer
    (``lightning_ddp``), ``sparse_peer_size`` for the sparse-gradient one (``lightning_sparse``). The GPU sizes
    have their own keys (``recshard_vs_raw_criteo_onehot``, ``recshard_vs_lightning_sparse_criteo_multihot``, ...),
    and so has the sparse peer at each CPU size (``recshard_vs_lightning_sparse_realistic``, ``_large``, ``_realistic_2proc``).
    A ratio that was not measured is ``None``.
    """
    tiny = results.get("tiny", {})
    overhead = None
    if "recshard" in tiny and "raw" in tiny:
        overhead = round(
            statistics.median(tiny["recshard"]["ms_per_step"]) - statistics.median(tiny["raw"]["ms_per_step"]), 4
        )
    big, sparse_big = _peer_size(results, "lightning_ddp"), _peer_size(results, "lightning_sparse")
    record: dict[str, Any] = {
        "recshard_vs_raw": _ratio(results, "realistic", "recshard", "raw"),
        "pipelined_vs_raw_pipeline": _ratio(results, "realistic", "recshard_pipelined", "raw_pipeline"),
        "pipelined_vs_raw_pipeline_2proc": _ratio(results, "realistic_2proc", "recshard_pipelined", "raw_pipeline"),
        "overhead_ms": overhead,
        "recshard_vs_raw_2proc": _ratio(results, "realistic_2proc", "recshard", "raw"),
        "recshard_vs_lightning_ddp": _ratio(results, big, "recshard", "lightning_ddp"),
        "recshard_vs_lightning_sparse": _ratio(results, sparse_big, "recshard", "lightning_sparse"),
        "rss_recshard_vs_raw": _ratio(results, "realistic", "recshard", "raw", "peak_rss_mb"),
        "rss_recshard_vs_lightning_ddp": _ratio(results, big, "recshard", "lightning_ddp", "peak_rss_mb"),
        "rss_recshard_vs_lightning_sparse": _ratio(results, sparse_big, "recshard", "lightning_sparse", "peak_rss_mb"),
        "tables_dominate_size": big,
        "sparse_peer_size": sparse_big,
        "raw_pipeline_vs_raw": _ratio(results, "realistic", "raw_pipeline", "raw"),
        "checked_vs_unchecked": _ratio(results, "realistic", "recshard", "recshard_unchecked"),
        "checked_vs_unchecked_tiny": _ratio(results, "tiny", "recshard", "recshard_unchecked"),
        "lightning_overhead_ms": _difference(results, "tiny", "lightning_sparse", "plain_sparse"),
        "recshard_overhead_beyond_lightnings_ms": _beyond(results),
        "strict_vs_default": _ratio(results, "realistic", "recshard_strict", "recshard"),
        "strict_vs_default_tiny": _ratio(results, "tiny", "recshard_strict", "recshard"),
    }
    # The sparse peer at every CPU size it was measured at (issue 26: recshard >= it at each).
    for name in ("realistic", "large", "realistic_2proc"):
        record[f"recshard_vs_lightning_sparse_{name}"] = _ratio(results, name, "recshard", "lightning_sparse")
    for name in GPU_SIZES:
        record[f"recshard_vs_raw_{name}"] = _ratio(results, name, "recshard", "raw")
        record[f"pipelined_vs_raw_pipeline_{name}"] = _ratio(results, name, "recshard_pipelined", "raw_pipeline")
        record[f"recshard_vs_lightning_sparse_{name}"] = _ratio(results, name, "recshard", "lightning_sparse")
        record[f"recshard_vs_lightning_ddp_{name}"] = _ratio(results, name, "recshard", "lightning_ddp")
        record[f"pipelined_vs_lightning_sparse_{name}"] = _ratio(
            results, name, "recshard_pipelined", "lightning_sparse"
        )
    record["by_size"] = {label: _medians(per_variant) for label, per_variant in results.items()}
    record["repeats"] = repeats
    return record


def plot_batch_sweep(results: Results, path: str) -> None:
    """Write a PNG of median samples/s against batch size, one line per variant, for every swept size.

    ``results`` labels are ``"<size>@<batch>"`` (see :func:`main`'s ``--batch-sizes``). Needs matplotlib.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sweeps: dict[str, dict[str, list[Any]]] = {}
    for label, per_variant in results.items():
        name, _, batch = label.partition("@")
        if not batch:
            continue
        for variant, values in per_variant.items():
            sweeps.setdefault(name, {}).setdefault(variant, []).append(
                (int(batch), statistics.median(values["samples_per_s"]))
            )
    fig = Figure(figsize=(6.5 * max(1, len(sweeps)), 4.5))
    FigureCanvasAgg(fig)
    for i, (name, curves) in enumerate(sorted(sweeps.items())):
        ax = fig.add_subplot(1, max(1, len(sweeps)), i + 1)
        for variant in VARIANTS + EXTRA_VARIANTS:
            if variant in curves:
                xs, ys = zip(*sorted(curves[variant]))
                ax.plot(xs, ys, marker="o", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (per process)")
        ax.set_ylabel("samples/s (median over repeats)")
        ax.set_title(f"{name}: {SIZES[name].tables} tables x {SIZES[name].rows:,} x {SIZES[name].dim}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); returns the final JSON record."""
    import torch

    parser = argparse.ArgumentParser(
        prog="python -m lightning_rec.testing.bench",
        description="recshard vs hand-written TorchRec vs plain Lightning, A/B alternated",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer steps and repeats (sizes tiny/realistic/2proc in a few minutes on 2 cores)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="alternated repeats per variant (default 3, quick 2)")
    parser.add_argument(
        "--sizes", default="tiny,realistic,realistic_2proc", help=f"comma-separated, of {', '.join(SIZES)}"
    )
    parser.add_argument("--variants", default=None, help=f"comma-separated (default: {','.join(VARIANTS)})")
    parser.add_argument(
        "--batch-sizes",
        default=None,
        help="comma-separated: sweep every size over these batch sizes (one value: that batch size, no sweep)",
    )
    parser.add_argument(
        "--rows", type=int, default=None, help="rows of every table at every size (shrinks the GPU sizes for CPU)"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps at every size (after --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first at every size (after --quick)")
    parser.add_argument("--plot", default=None, help="PNG path: samples/s against batch size (with --batch-sizes)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="sgd",
        help="torch.optim.SGD/Adagrad for the dense layers and the plain-Lightning tables, FBGEMM's exact "
        "equivalent (EXACT_SGD/EXACT_ADAGRAD) fused for TorchRec's tables (default: sgd)",
    )
    parser.add_argument(
        "--malloc",
        choices=sorted(MALLOC_SETTINGS),
        default="steady",
        help="glibc heap settings of every variant's processes (default: steady; see BENCHMARKS.md)",
    )
    parser.add_argument("--sharding", choices=SHARDINGS, default="table_wise", help="every table's sharding type")
    parser.add_argument("--allow-cpu", action="store_true", help="run the GPU sizes at full size without a GPU")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size-json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.worker, Size(**json.loads(args.size_json)), args.lr)
        return {}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b] if args.batch_sizes else []
    if args.plot and len(batch_sizes) < 2:
        parser.error("--plot draws a batch-size sweep: give --batch-sizes too (two values or more)")
    repeats = args.repeats or (2 if args.quick else 3)
    variants = [v for v in (args.variants or ",".join(VARIANTS)).split(",") if v]
    size_names = [n for n in args.sizes.split(",") if n]
    unknown = sorted(set(variants) - set(VARIANTS + EXTRA_VARIANTS)) + sorted(set(size_names) - set(SIZES))
    if unknown:
        parser.error(
            f"unknown variant/size {unknown}; variants are {list(VARIANTS + EXTRA_VARIANTS)}, sizes {list(SIZES)}"
        )
    for flag, value in (("--rows", args.rows), ("--steps", args.steps), ("--warmup", args.warmup)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value} (the first step allocates: it is never timed)")
    cuda = torch.cuda.is_available()
    for name in size_names:
        size = SIZES[name]
        if size.gpu and not cuda and args.rows is None and not args.allow_cpu:
            print(
                f"{name} is GPU-sized ({size.tables} tables x {size.rows:,} rows x {size.dim} = "
                f"{_gb(size.table_bytes())} of fp32 tables; lightning_ddp needs as much again for its dense "
                f"gradients, adagrad once more) and there is no GPU here: it runs with {CPU_ROWS:,} rows per table "
                "(the same batches and model). --rows N sets another number, --allow-cpu runs it at full size.",
                flush=True,
            )
        if cuda and size.world_size > 1 and "lightning_sparse" in variants and args.variants:
            parser.error(
                f"lightning_sparse cannot run at {name} ({size.world_size} processes) on CUDA: DDP would "
                "all-reduce sparse gradients, which gloo does and NCCL does not. HINT: use a 1-process size, "
                "or leave lightning_sparse out of --variants."
            )
    results: Results = {}
    measured: dict[str, dict[str, Any]] = {}
    for size_name in size_names:
        size = replace(SIZES[size_name], sharding=args.sharding, optimizer=args.optimizer)
        if args.quick:
            size = replace(size, steps=max(10, size.steps // 4), warmup=max(3, size.warmup // 2))
        rows = args.rows or (CPU_ROWS if size.gpu and not cuda and not args.allow_cpu else size.rows)
        size = replace(size, rows=rows, steps=args.steps or size.steps, warmup=args.warmup or size.warmup)
        size_variants = variants
        if cuda and size.world_size > 1 and "lightning_sparse" in variants:
            size_variants = [v for v in variants if v != "lightning_sparse"]
            print(
                f"{size.name}: lightning_sparse left out ({size.world_size} processes on CUDA: NCCL has no sparse "
                "all-reduce for DDP); its ratios there are None",
                flush=True,
            )
        if size.world_size > 1 and "plain_sparse" in size_variants:
            size_variants = [v for v in size_variants if v != "plain_sparse"]
            print(f"{size.name}: plain_sparse left out (a plain loop runs one process)", flush=True)
        for batch in batch_sizes or [size.batch_size]:
            label = f"{size.name}@{batch}" if len(batch_sizes) > 1 else size.name
            sized = replace(size, batch_size=batch)
            results[label] = measure(sized, size_variants, repeats, args.lr, args.malloc)
            measured[label] = {k: v for k, v in asdict(sized).items() if k not in ("name", "gpu")}
    print(
        f"\n{'size':22s} {'variant':18s} {'ms/step':>9s} {'samples/s':>11s} {'peak RSS MB':>12s} {'faults/step':>12s} "
        f"{'emb GB/s':>9s} {'copy GB/s':>10s} {'emb/copy':>9s}"
    )
    for label, per_variant in results.items():
        for variant, values in per_variant.items():
            print(
                f"{label:22s} {variant:18s} {statistics.median(values['ms_per_step']):9.2f} "
                f"{statistics.median(values['samples_per_s']):11.0f} {statistics.median(values['peak_rss_mb']):12.0f} "
                f"{statistics.median(values['page_faults_per_step']):12.0f} {statistics.median(values['emb_gb_s']):9.3f} "
                f"{statistics.median(values['copy_gb_s']):10.2f} {statistics.median(values['emb_bw_frac']):9.4f}"
            )
    if args.plot:
        plot_batch_sweep(results, args.plot)
        print(f"plot: {args.plot}")
    final = {
        **final_record(results, repeats),
        "malloc": args.malloc,
        "optimizer": args.optimizer,
        "sharding": args.sharding,
        "device": "cuda" if cuda else "cpu",
        "measured": measured,
    }
    print(json.dumps(final), flush=True)
    return final
