"""Serving on torch.export + AOTInductor (``.pt2``) against TorchScript and the training module: artifact sizes,
export/compile time and CPU latency per call (p50, p99) at 1, 64 and 512 rows on one intra-op thread, for the main
job's DeepFM and a Criteo-shaped DLRM (26 tables), all in one process (BENCHMARKS.md "Serving on torch.export +
AOTInductor").

    .venv/bin/python benchmarks/serving_pt2.py                  # trains both checkpoints first: ~2.5 min in all
    .venv/bin/python benchmarks/serving_pt2.py --deepfm runs/movielens_deepfm/lightning_logs/version_0/checkpoints/last.ckpt

Checkpoints, unless given:

- DeepFM: the main job, run as the README says (``lightning-rec fit --config examples/configs/movielens_deepfm.yaml``:
  4 epochs on 2 processes, ~20 s), in a subprocess, into the work folder.
- DLRM: ``DLRMModule`` with 13 dense features and 26 one-hot tables of Criteo Kaggle's sizes capped at
  ``--max-rows`` (100,000: 7 tables capped, 840,543 rows in all), the architecture of
  ``examples/configs/criteo_dlrm.yaml`` (dimension 64, dense [512, 256, 64], over [512, 512, 256, 1], dot
  interaction), trained ``--dlrm-steps`` steps of 512 synthetic rows on one process (power-law ids), only so that the
  weights are not the initial ones: latency does not depend on them.

Each checkpoint is exported per table dtype (``--dtypes``) in both formats with ``export_inference`` (the default
``bounds_check="error"``), in this process with its default threads (as ``lightning-rec export`` runs); the time of
each export is reported (for ``.pt2``: capture, AOTInductor's C++ compile, packaging and the round-trip check). Then
``torch.set_num_threads(1)`` and, per row count, every variant is called on the same inputs, interleaved call by call
(the order rotated each round, so that the machine's noise and any cache left by the previous call hit all of them):
the ``.pt2`` through :func:`~lightning_rec.serving.load_pt2` with and without its host-side input check
(``check_inputs=False``; the package's in-graph checks run either way), the TorchScript artifact
(:func:`~lightning_rec.serving.load_inference`), and the training module's eval forward (``load_from_checkpoint``,
fp32 tables, as ``benchmarks/serving.py``). Each call is timed alone (``time.perf_counter``); the artifacts get the
tensors ``serving_inputs`` builds (built once, outside the timing), the module gets the ``Batch``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml

from lightning_rec import EmbeddingOptimizer, RecShardStrategy
from lightning_rec.data import MovieLensDataModule, SyntheticDataModule, SyntheticTable
from lightning_rec.models import DLRMModule
from lightning_rec.serving import export_inference, load_inference, load_pt2, serving_inputs
from lightning_rec.testing import QUIET_TRAINER

REPO = Path(__file__).resolve().parents[1]
DEEPFM_CONFIG = "examples/configs/movielens_deepfm.yaml"
# Rows per categorical feature of Criteo's Kaggle display-advertising data (TorchRec's DLRM example,
# --num_embeddings_per_feature), cat_0 ... cat_25.
CRITEO_KAGGLE_ROWS = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
ROW_COUNTS = (1, 64, 512)
VARIANTS = ("eager", "torchscript", "pt2", "pt2, no host check")


def _deepfm_checkpoint(work: Path, data_dir: str) -> Path:
    """The main job, as the README runs it, into ``work``; its ``last.ckpt``."""
    command = [
        sys.executable, "-m", "lightning_rec", "fit", "--config", DEEPFM_CONFIG,
        f"--trainer.default_root_dir={work}", f"--data.init_args.data_dir={data_dir}",
        "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    print("$ lightning-rec " + " ".join(command[3:]), flush=True)
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    print(f"  main job: {time.perf_counter() - start:.1f} s", flush=True)
    return work / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"


def _criteo_data(max_rows: int, rows: int) -> SyntheticDataModule:
    tables = [
        SyntheticTable(f"cat_{i}", min(n, max_rows), distribution="power_law") for i, n in enumerate(CRITEO_KAGGLE_ROWS)
    ]
    return SyntheticDataModule(tables, num_dense_features=13, train_rows=rows, val_rows=max(ROW_COUNTS), batch_size=512)


def _dlrm_checkpoint(work: Path, max_rows: int, steps: int) -> Path:
    """A Criteo-shaped DLRM (``criteo_dlrm.yaml``'s architecture), trained ``steps`` steps on one process."""
    dm = _criteo_data(max_rows, 512 * steps)
    module = DLRMModule(
        dm.sparse_features,
        dm.num_dense_features,
        embedding_dim=64,
        dense_arch_layer_sizes=[512, 256, 64],
        over_arch_layer_sizes=[512, 512, 256, 1],
        interaction="dot",
        embedding_optimizer=EmbeddingOptimizer("rowwise_adagrad", lr=0.02),
        dense_optimizer="adagrad",
        dense_lr=0.02,
    )
    trainer = L.Trainer(
        strategy=RecShardStrategy(), accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, **QUIET_TRAINER
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    path = work / "dlrm.ckpt"
    trainer.save_checkpoint(path)
    print(f"  Criteo-shaped DLRM: {steps} steps and the checkpoint, {time.perf_counter() - start:.1f} s", flush=True)
    return path


def _pt2_parts(package: Path) -> tuple[int, int]:
    """Bytes of the compiled code (``.so``) and of everything else in the package (the tables' blob, the dense
    weights, the spec)."""
    with zipfile.ZipFile(package) as z:
        so = sum(i.file_size for i in z.infolist() if i.filename.endswith(".so"))
        return so, sum(i.file_size for i in z.infolist()) - so


def _percentiles(times: list[float]) -> tuple[float, float]:
    return statistics.median(times), statistics.quantiles(times, n=100, method="inclusive")[98]


def _interleaved(calls: dict[str, Callable[[], Any]], n: int, warmup: int) -> dict[str, tuple[float, float]]:
    """p50 and p99 in ms of ``n`` timed calls of each, interleaved, the order rotated each round."""
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            start = time.perf_counter()
            calls[name]()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: _percentiles(t) for name, t in times.items()}


def _bench(label: str, ckpt: Path, rows_of: Callable[[int], Any], args: argparse.Namespace, work: Path) -> list[str]:
    """Export ``ckpt`` per dtype and format, print its sizes and export times, and return its latency table rows."""
    torch.set_num_threads(args.threads)  # the process default (training may have changed it), as an export runs
    artifacts: dict[tuple[str, str], Path] = {}
    specs = {}
    for dtype in args.dtypes:
        for fmt, suffix in (("torchscript", "pt"), ("pt2", "pt2")):
            path = artifacts[dtype, fmt] = work / f"{label}_{dtype}.{suffix}"
            start = time.perf_counter()
            specs[dtype, fmt] = export_inference(ckpt, path, format=fmt, table_dtype=dtype)
            seconds = time.perf_counter() - start
            size = path.stat().st_size
            parts = "{:,} + {:,}".format(*_pt2_parts(path)) if fmt == "pt2" else ""
            print(f"| {label} | {dtype} | {fmt} | {size:,} | {parts} | {seconds:.1f} |", flush=True)
    model = specs[args.dtypes[0], "pt2"].model
    module_name, _, class_name = model.rpartition(".")
    module = getattr(importlib.import_module(module_name), class_name).load_from_checkpoint(ckpt).eval()

    torch.set_num_threads(1)
    loaded: dict[tuple[str, str], Callable[..., Any]] = {}
    for dtype in args.dtypes:
        loaded[dtype, "torchscript"] = load_inference(artifacts[dtype, "torchscript"])
        loaded[dtype, "pt2"] = load_pt2(artifacts[dtype, "pt2"])
        loaded[dtype, "pt2, no host check"] = load_pt2(artifacts[dtype, "pt2"], check_inputs=False)
    lines = []
    for rows in ROW_COUNTS:
        batch = rows_of(rows)
        calls: dict[str, Callable[[], Any]] = {"eager": lambda b=batch: module(b)}
        for (dtype, variant), fn in loaded.items():
            spec = specs[dtype, "pt2" if "pt2" in variant else variant]
            inputs = serving_inputs(spec, batch.sparse_features, batch.dense_features)
            calls[f"{dtype} {variant}"] = lambda fn=fn, inputs=inputs: fn(*inputs)
        with torch.inference_mode():
            outputs = {name: call() for name, call in calls.items()}
            for dtype in args.dtypes:  # the formats serve the same probabilities
                pt2, script = outputs[f"{dtype} pt2"], outputs[f"{dtype} torchscript"]
                if not torch.allclose(pt2, script, rtol=1e-5, atol=1e-6):
                    worst = float((pt2 - script).abs().max())
                    raise RuntimeError(f"{label} {dtype}, {rows} rows: .pt2 and TorchScript differ by {worst:.3g}")
            n = args.calls_512 if rows == 512 else args.calls
            stats = _interleaved(calls, n, args.warmup)
        eager = "{:.3f} / {:.3f}".format(*stats["eager"])
        for dtype in args.dtypes:
            cell = {v: stats[f"{dtype} {v}"] for v in VARIANTS[1:]}
            script = cell["torchscript"]
            ratios = [f"{cell[v][0] / script[0]:.2f} / {cell[v][1] / script[1]:.2f}" for v in VARIANTS[2:]]
            lines.append(
                f"| {label} | {rows} | {n} | {dtype} | {eager} | "
                + " | ".join("{:.3f} / {:.3f}".format(*cell[v]) for v in VARIANTS[1:])
                + f" | {' | '.join(ratios)} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepfm", help="the main job's checkpoint (default: run the main job first)")
    parser.add_argument("--dlrm", help="a Criteo-shaped DLRM checkpoint (default: train one, see --dlrm-steps)")
    parser.add_argument("--data-dir", default="data/ml-100k", help="MovieLens-100K (the DeepFM's rows)")
    parser.add_argument("--max-rows", type=int, default=100_000, help="cap on the DLRM's table rows")
    parser.add_argument("--dlrm-steps", type=int, default=20)
    parser.add_argument("--dtypes", default="int8,fp32", help="table dtypes, comma-separated")
    parser.add_argument("--calls", type=int, default=300, help="timed calls per variant at 1 and 64 rows")
    parser.add_argument("--calls-512", type=int, default=100, help="timed calls per variant at 512 rows")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls per variant first")
    parser.add_argument("--models", default="deepfm,dlrm", help="which models, comma-separated")
    parser.add_argument("--work", help="folder for checkpoints and artifacts (default: a new temporary one)")
    args = parser.parse_args()
    args.dtypes = args.dtypes.split(",")
    args.threads = torch.get_num_threads()
    models = args.models.split(",")
    work = Path(args.work or tempfile.mkdtemp(prefix="serving_pt2_"))
    work.mkdir(parents=True, exist_ok=True)
    wall = time.perf_counter()
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.threads} intra-op threads for the exports, load "
        f"average {os.getloadavg()}; work folder {work}"
    )

    checkpoints: dict[str, tuple[Path, Callable[[int], Any]]] = {}
    if "deepfm" in models:
        ckpt = Path(args.deepfm) if args.deepfm else _deepfm_checkpoint(work / "deepfm", args.data_dir)
        init_args = yaml.safe_load((REPO / DEEPFM_CONFIG).read_text())["data"]["init_args"]
        val = MovieLensDataModule(**{**init_args, "data_dir": args.data_dir}).split("val")
        checkpoints["deepfm"] = (ckpt, lambda rows: val[torch.arange(rows)])
    if "dlrm" in models:
        ckpt = Path(args.dlrm) if args.dlrm else _dlrm_checkpoint(work, args.max_rows, args.dlrm_steps)
        dm = _criteo_data(args.max_rows, 1)
        dm.setup("fit")
        rows_val = dm.split("val")
        checkpoints["dlrm"] = (ckpt, lambda rows: rows_val[torch.arange(rows)])

    print("\n| model | tables | format | artifact (B) | .pt2: .so + rest (B) | export (s) |\n|---|---|---|---|---|---|")
    lines = []
    for label, (ckpt, rows_of) in checkpoints.items():
        lines += _bench(label, ckpt, rows_of, args, work)
    print(
        "\nms per call, p50 / p99, 1 intra-op thread; the last columns: .pt2 / TorchScript (p50 / p99)\n"
        "| model | rows | calls | tables | eager module | TorchScript | .pt2 | .pt2, no host check | .pt2 / TS "
        "| .pt2 no host check / TS |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    print("\n".join(lines))
    print(f"\nwhole run: {time.perf_counter() - wall:.0f} s; load average now {os.getloadavg()}")


if __name__ == "__main__":
    main()
