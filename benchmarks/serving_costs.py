"""What serving costs (issue 45, item 8; BENCHMARKS.md "Serving costs"): the peak memory and time of an export of a
large table, and the cold and warm load of a ``.pt2`` package in a fresh process, against TorchScript's.

    .venv/bin/python benchmarks/serving_costs.py export --rows 5000000 --dim 64     # ~6 min, ~3 GB of disk
    .venv/bin/python benchmarks/serving_costs.py load --rows 100000                 # ~3 min
    .venv/bin/python benchmarks/serving_costs.py latency                            # ~10 min: 12 compiles

``export``: a DLRM with one ``--rows`` x ``--dim`` table (and a 1,000-row one) is trained one step on one process and
saved; each (format, table dtype) is then exported by ``export_inference`` in a fresh child process, which reports its
resident memory after its imports (``VmRSS``), its peak (``VmHWM``, ``/proc/self/status``) and the export's wall time,
and the peak and time of each stage (loading the checkpoint, quantizing, TorchScript's compile or ``torch.export``,
AOTInductor's compile and packaging, the spec and manifest, the round-trip check). Memory is given as a ratio to the big
table's fp32 size (``rows x dim x 4`` bytes): the target is a peak under 2x.

``load``: the package and the TorchScript artifact of the same checkpoint are loaded in fresh child processes, each
with a new, empty ``TORCHINDUCTOR_CACHE_DIR`` (cold) and then with the cache the first left (warm), by
:func:`~lightning_rec.serving.load_pt2`, ``torch._inductor.aoti_load_package`` and
:func:`~lightning_rec.serving.load_inference`. Each child runs with ``CXX`` and ``PATH`` pointing at a recorder
that logs every call of a C++ compiler before running the real one; it reports the load's wall time (after
``import torch, fbgemm_gpu`` and the loader's own module), the compiler calls, and whether ``setuptools`` was imported.

``latency``: every shipped zoo config (``examples/configs``: DLRM-DCNv2, DeepFM, the synthetic DLRM, the two-tower
model's query and candidate towers, SASRec) is trained 4 steps with ``lightning-rec fit`` on one process, and each
served part exported as TorchScript and as ``.pt2`` for the ``portable`` and the ``native`` CPU target. On one
intra-op thread, per batch of 1, 64 and 512 samples (the spec's seeded warm-up request, drawn over the whole tables,
0 to 3 ids per feature), the TorchScript artifact (``load_inference``), both packages through ``load_pt2`` and the
portable one through ``torch._inductor.aoti_load_package`` are called interleaved, call by call, on the same
tensors, every input check on (the artifacts' compiled-in checks; ``load_pt2`` adds nothing to a correct call); the
median of each and its ratio to TorchScript's are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FORMATS = (("torchscript", "pt"), ("pt2", "pt2"))


def _status(field: str) -> int:
    """``field`` of ``/proc/self/status`` in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _checkpoint(work: Path, rows: int, dim: int) -> Path:
    """A DLRM with a ``rows`` x ``dim`` table and a small one, trained one step on one process."""
    import lightning as L

    from lightning_rec import EmbeddingOptimizer, RecShardStrategy
    from lightning_rec.data import SyntheticDataModule, SyntheticTable
    from lightning_rec.models import DLRMModule
    from lightning_rec.testing import QUIET_TRAINER

    dm = SyntheticDataModule(
        [SyntheticTable("big", rows, distribution="power_law"), SyntheticTable("small", 1000)],
        num_dense_features=4,
        train_rows=256,
        val_rows=64,
        batch_size=256,
    )
    module = DLRMModule(
        dm.sparse_features,
        dm.num_dense_features,
        embedding_dim=dim,
        dense_arch_layer_sizes=[64, dim],
        over_arch_layer_sizes=[64, 1],
        embedding_optimizer=EmbeddingOptimizer("rowwise_adagrad", lr=0.02),
    )
    trainer = L.Trainer(
        strategy=RecShardStrategy(), accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, **QUIET_TRAINER
    )
    trainer.fit(module, datamodule=dm)
    path = work / "ckpt"
    trainer.save_checkpoint(path)
    return path


# The steps of an export whose peak and time the child reports (--stages): module, name.
STAGES = (
    ("lightning_rec.checkpoint._export", "load_module"),
    ("lightning_rec.serving.export", "quantize"),
    ("lightning_rec.serving.export", "_script"),
    ("torch.export", "export"),
    ("torch._inductor", "aoti_compile_and_package"),
    ("lightning_rec.serving.pt2", "_with_spec"),
    ("lightning_rec.serving.pt2", "seal"),
    ("lightning_rec.serving.pt2", "_round_trip"),
)


def _export_child(checkpoint: str, output: str, fmt: str, dtype: str) -> None:
    """Run in a fresh process: one export, its memory and time (and each stage's) as JSON on the last line."""
    import importlib

    import torch  # noqa: F401

    from lightning_rec.serving import export_inference

    stages: list[dict[str, Any]] = []

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start, peak_before = time.perf_counter(), _status("VmHWM")
            Path("/proc/self/clear_refs").write_text("5")  # the peak restarts here (Linux: resets VmHWM)
            try:
                return fn(*args, **kwargs)
            finally:
                stages.append({"stage": name, "peak": _status("VmHWM"), "seconds": time.perf_counter() - start})
                overall["peak"] = max(overall["peak"], peak_before, stages[-1]["peak"])

        return call

    overall = {"peak": 0}
    for module_name, name in STAGES:
        module = importlib.import_module(module_name)
        setattr(module, name, timed(name, getattr(module, name)))
    before = _status("VmRSS")
    start = time.perf_counter()
    export_inference(checkpoint, output, format=fmt, table_dtype=dtype)  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    peak = max(overall["peak"], _status("VmHWM"))
    print(json.dumps({"before": before, "peak": peak, "seconds": seconds, "stages": stages}))


def _run_child(args: list[str], env: dict[str, str] | None = None) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, *args], cwd=REPO, env=env, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"child {args} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def export_costs(args: argparse.Namespace, work: Path) -> None:
    start = time.perf_counter()
    ckpt = Path(args.checkpoint) if args.checkpoint else _checkpoint(work, args.rows, args.dim)
    table = args.rows * args.dim * 4
    print(f"checkpoint: {time.perf_counter() - start:.0f} s; the big table in fp32: {table / 1e9:.2f} GB", flush=True)
    print(
        "\n| format | tables | peak RSS (GB) | / table | RSS after imports (GB) | (peak - imports) / table | export (s) "
        "| artifact (GB) |\n|---|---|---|---|---|---|---|---|"
    )
    stages = []
    for dtype in args.dtypes.split(","):
        for fmt, suffix in FORMATS:
            if fmt not in args.formats.split(","):
                continue
            out = work / f"model_{dtype}.{suffix}"
            got = _run_child(["_export", str(ckpt), str(out), fmt, dtype])
            print(
                f"| {fmt} | {dtype} | {got['peak'] / 1e9:.2f} | {got['peak'] / table:.2f} | {got['before'] / 1e9:.2f} "
                f"| {(got['peak'] - got['before']) / table:.2f} | {got['seconds']:.1f} "
                f"| {out.stat().st_size / 1e9:.2f} |",
                flush=True,
            )
            stages += [(fmt, dtype, stage) for stage in got["stages"]]
            out.unlink()
    print("\n| format | tables | stage | its peak RSS (GB) | / table | time (s) |\n|---|---|---|---|---|---|")
    for fmt, dtype, stage in stages:
        print(
            f"| {fmt} | {dtype} | {stage['stage']} | {stage['peak'] / 1e9:.2f} | {stage['peak'] / table:.2f} "
            f"| {stage['seconds']:.1f} |"
        )


# A C++ compiler stand-in: logs each call, then runs the real compiler.
_RECORDER = """#!/bin/sh
echo "$0 $*" >> "{log}"
exec {real} "$@"
"""

LOADERS = ("load_pt2", "aoti_load_package", "load_inference")


def _load_child(artifact: str, loader: str) -> None:
    """Run in a fresh process: load ``artifact`` with ``loader`` and call it once (its spec's warm-up request)."""
    import fbgemm_gpu  # noqa: F401
    import torch

    start = time.perf_counter()
    if loader == "load_pt2":
        from lightning_rec.serving import load_pt2

        imported = time.perf_counter()
        model: Any = load_pt2(artifact)
        spec = model.spec
    elif loader == "aoti_load_package":
        from lightning_rec.serving import pt2_spec

        imported = time.perf_counter()
        model, spec = torch._inductor.aoti_load_package(artifact), pt2_spec(artifact)
    else:
        from lightning_rec.serving import inference_spec, load_inference

        imported = time.perf_counter()
        model, spec = load_inference(artifact), inference_spec(artifact)
    loaded = time.perf_counter()
    from lightning_rec.serving import warm_up

    warm_up(model, spec)
    print(
        json.dumps(
            {
                "import": imported - start,
                "load": loaded - imported,
                "first_call": time.perf_counter() - loaded,
                "setuptools": "setuptools" in sys.modules,
            }
        )
    )


def load_costs(args: argparse.Namespace, work: Path) -> None:
    from lightning_rec.serving import export_inference

    ckpt = Path(args.checkpoint) if args.checkpoint else _checkpoint(work, args.rows, args.dim)
    dtype = args.dtypes.split(",")[0]
    export_inference(ckpt, work / "model.pt2", table_dtype=dtype)  # type: ignore[arg-type]
    export_inference(ckpt, work / "model.pt", table_dtype=dtype)  # type: ignore[arg-type]
    bin_dir = work / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = work / "compiler-calls.log"
    real = shutil.which("g++") or "/usr/bin/g++"
    for name in ("g++", "c++", "gcc", "cc", "clang++", "clang"):
        (bin_dir / name).write_text(_RECORDER.format(log=log, real=real))
        (bin_dir / name).chmod(0o755)
    print(
        f"\n{args.rows:,} x {args.dim} table, {dtype}; seconds (import: the loader's lightning_rec module, after torch "
        "and fbgemm_gpu)\n| loader | cache | load (s) | first call (s) | import (s) | compiler calls | setuptools "
        "imported |\n|---|---|---|---|---|---|---|"
    )
    for loader in LOADERS:
        cache = work / f"cache_{loader}"
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir()
        for state in ("cold (empty)", "warm"):
            log.unlink(missing_ok=True)
            env = {
                **os.environ,
                "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                "CXX": str(bin_dir / "g++"),
                "TORCHINDUCTOR_CACHE_DIR": str(cache),
                "PYTHONWARNINGS": "ignore",
            }
            artifact = work / ("model.pt" if loader == "load_inference" else "model.pt2")
            got = _run_child(["_load", str(artifact), loader], env)
            calls = len(log.read_text().splitlines()) if log.exists() else 0
            print(
                f"| {loader} | {state} | {got['load']:.2f} | {got['first_call']:.3f} | {got['import']:.1f} | {calls} "
                f"| {got['setuptools']} |",
                flush=True,
            )


# The zoo's models as shipped (examples/configs), each served part: name -> (config, part).
ZOO = {
    "DLRM-DCNv2": ("movielens_dlrm.yaml", None),
    "DeepFM": ("movielens_deepfm.yaml", None),
    "DLRM (synthetic)": ("synthetic_dlrm.yaml", None),
    "two-tower query": ("movielens_two_tower.yaml", "query"),
    "two-tower candidate": ("movielens_two_tower.yaml", "candidate"),
    "SASRec": ("movielens_sasrec.yaml", None),
}


def _trained(config: str, work: Path, data_dir: str) -> Path:
    """The shipped ``config`` trained 4 steps on one process (only so that its weights are not the initial ones), as
    a user runs it (``lightning-rec fit``); its checkpoint."""
    root = work / config.removesuffix(".yaml")
    command = [
        sys.executable, "-m", "lightning_rec", "fit", "--config", f"examples/configs/{config}",
        f"--trainer.default_root_dir={root}", "--trainer.max_steps=4", "--trainer.devices=1",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    if config.startswith("movielens"):
        command.append(f"--data.init_args.data_dir={data_dir}")
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    found = sorted(root.rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RuntimeError(f"{config}: no checkpoint under {root}")
    return found[-1]


def latency(args: argparse.Namespace, work: Path) -> None:
    import torch
    from serving_pt2 import _interleaved  # the sibling benchmark's timing loop (this script's folder is on the path)

    from lightning_rec.serving import export_inference, load_inference, load_pt2
    from lightning_rec.serving.artifact import warmup_inputs

    threads = torch.get_num_threads()
    names = [n for n in ZOO if not args.models or n in args.models.split(",")]
    checkpoints: dict[str, Path] = {}
    print(
        "\nms per call (median), 1 intra-op thread; ratios to TorchScript in the same run\n"
        "| model | rows | TorchScript | .pt2 portable | .pt2 native | aoti_load_package (portable) "
        "| portable / TS | native / TS | aoti_load_package / TS |\n|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    for name in names:
        config, part = ZOO[name]
        if config not in checkpoints:
            checkpoints[config] = _trained(config, work, args.data_dir)
        ckpt = checkpoints[config]
        torch.set_num_threads(threads)  # exports run with the process's threads, as `lightning-rec export` does
        stem = work / name.replace(" ", "_").replace("(", "").replace(")", "")
        spec = export_inference(ckpt, f"{stem}.pt", part=part, table_dtype=args.dtypes.split(",")[0])
        for cpu in ("portable", "native"):
            export_inference(ckpt, f"{stem}_{cpu}.pt2", part=part, table_dtype=spec.table_dtype, cpu=cpu)  # type: ignore[arg-type]
        torch.set_num_threads(1)
        loaded = {
            "ts": load_inference(f"{stem}.pt"),
            "portable": load_pt2(f"{stem}_portable.pt2"),
            "native": load_pt2(f"{stem}_native.pt2"),
            "aoti": torch._inductor.aoti_load_package(f"{stem}_portable.pt2"),
        }
        for rows in (1, 64, 512):
            dense, values, lengths, weights = warmup_inputs(spec, batch=rows)
            inputs = [dense] if spec.num_dense_features else []
            inputs += [values, lengths] + ([weights] if spec.weighted else [])
            calls = {k: (lambda fn=fn, inputs=inputs: fn(*inputs)) for k, fn in loaded.items()}
            with torch.inference_mode():
                want = calls["ts"]()
                for k, call in calls.items():
                    if not torch.allclose(call(), want, rtol=1e-5, atol=1e-6):
                        raise RuntimeError(f"{name}, {rows} rows: {k} differs from TorchScript")
                n = args.calls_512 if rows == 512 else args.calls
                ms = {name: p50 for name, (p50, _) in _interleaved(calls, n, args.warmup).items()}
            print(
                f"| {name} | {rows} | {ms['ts']:.3f} | {ms['portable']:.3f} | {ms['native']:.3f} | {ms['aoti']:.3f} "
                f"| {ms['portable'] / ms['ts']:.2f} | {ms['native'] / ms['ts']:.2f} | {ms['aoti'] / ms['ts']:.2f} |",
                flush=True,
            )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_export":
        _export_child(*sys.argv[2:6])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_load":
        _load_child(*sys.argv[2:4])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["export", "load", "latency"])
    parser.add_argument("--rows", type=int, default=5_000_000, help="the big table's rows")
    parser.add_argument("--dim", type=int, default=64, help="the tables' embedding dimension")
    parser.add_argument("--dtypes", default="int8", help="table dtypes, comma-separated")
    parser.add_argument("--formats", default="torchscript,pt2", help="formats, comma-separated")
    parser.add_argument("--data-dir", default="data/ml-100k", help="latency: MovieLens-100K, for the shipped configs")
    parser.add_argument("--models", help="latency: the zoo models, comma-separated (default: all)")
    parser.add_argument("--calls", type=int, default=300, help="latency: timed calls per variant at 1 and 64 rows")
    parser.add_argument("--calls-512", type=int, default=100, help="latency: timed calls per variant at 512 rows")
    parser.add_argument("--warmup", type=int, default=20, help="latency: untimed calls per variant first")
    parser.add_argument("--checkpoint", help="a checkpoint to export (default: train one, see --rows)")
    parser.add_argument("--work", help="folder for the checkpoint and artifacts (default: a temporary one, removed)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="serving_costs_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()}; work folder {work}", flush=True)
    try:
        if args.part == "export":
            export_costs(args, work)
        elif args.part == "load":
            load_costs(args, work)
        elif args.part == "latency":
            latency(args, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
