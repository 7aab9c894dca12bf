"""How fast TabularDataModule streams a Criteo-shaped table, per DataLoader worker, and how much memory it holds.

A Criteo-like table (a label, 13 integer columns, 26 categorical columns as 8-hex-digit text, like Criteo's) is
written as Parquet (row groups of 131,072 rows) and as CSV; the schema hashes every categorical column into 1M rows
and log1p-transforms the integers (the DLRM preprocessing). One process, no DataLoader worker (``num_workers=0``
is what one worker does): batches of 16,384 rows, as in the GPU bench, are built and counted; samples/s is rows /
wall time. Peak RSS growth is measured while streaming, against the file's size::

    .venv/bin/python benchmarks/tabular_throughput.py --rows 1000000     # ~2 min on 2 cores (writes ~0.4 GB in /tmp)

``--workers 0,1,2`` measures instead what a fit reads per rank (one process, rank 0 of 1) over ``--epochs`` epochs,
each a training pass and a validation pass over the same Parquet file: the in-memory loader (``stream=False``,
the table read once) and the stream with each of those DataLoader worker counts, in turn, ``--rounds`` times, each
in a fresh process;
samples/s is every row read (train and validation) / wall time, the workers' start included, and the same after the
first epoch (what persistent workers leave: no start)::

    .venv/bin/python benchmarks/tabular_throughput.py --rows 200000 --batch-size 4096 --workers 0,1,2 --epochs 4

``--fit 0,2`` times instead whole 2-rank fits (``lightning-rec fit``, recshard on 2 CPU processes, a DLRM over 8 of
the categorical columns hashed into 10,000 rows each and 4 integer columns), streaming the Parquet file with each of
those worker counts per rank, in turn, ``--rounds`` times; the wall time of the command, its start included (issue
38's run: 73 s with 2 workers against 15 s with none)::

    .venv/bin/python benchmarks/tabular_throughput.py --rows 200000 --batch-size 4096 --fit 0,1,2 --epochs 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

H100_SAMPLES_PER_S = 1.3e6  # what one H100 consumed in this project's GPU bench (BENCHMARKS.md, issue 14)


def write_tables(directory: Path, rows: int, seed: int = 0) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    parquet, csv = directory / "criteo.parquet", directory / "criteo.csv"
    writer = None
    with open(csv, "wb") as out:
        for start in range(0, rows, 131_072):
            n = min(131_072, rows - start)
            cols: dict[str, Any] = {"label": rng.integers(0, 2, n).astype(np.float32)}
            for i in range(13):
                cols[f"int_{i}"] = rng.integers(0, 1000, n).astype(np.float32)
            for i in range(26):
                cols[f"cat_{i}"] = np.char.mod("%08x", rng.integers(0, 2**32, n, dtype=np.uint64))
            table = pa.table(cols)
            writer = writer or pq.ParquetWriter(parquet, table.schema)
            writer.write_table(table)
            pacsv.write_csv(table, out, pacsv.WriteOptions(include_header=start == 0))
    assert writer is not None
    writer.close()
    return {"parquet": parquet, "csv": csv}


def measure(path: Path, batch_size: int) -> dict[str, float]:
    from lightning_rec.data import TabularDataModule

    schema = {
        "labels": [{"column": "label"}],
        "dense": [{"column": f"int_{i}", "transform": "log1p"} for i in range(13)],
        "sparse": [{"column": f"cat_{i}", "ids": "hash", "num_embeddings": 1_000_000} for i in range(26)],
    }
    dm = TabularDataModule(schema=schema, train=[str(path)], stream=True, batch_size=batch_size, window=4)
    dm.setup("fit")
    loader = dm.dataloader("train")
    before = _rss_mb()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    rows = sum(len(b.labels) for b in loader)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "rows": rows,
        "samples_per_s": rows / seconds,
        "workers_per_h100": H100_SAMPLES_PER_S / (rows / seconds),
        "file_mb": os.path.getsize(path) / 2**20,
        "peak_rss_growth_mb": max(peak, peak_before) - before,
    }


def measure_workers(path: Path, batch_size: int, workers: int | None, epochs: int) -> dict[str, float]:
    """Samples/s of ``epochs`` x (a training pass + a validation pass) over ``path``, streamed with ``workers``
    DataLoader workers, or in memory (``workers=None``): ``all`` (the module's setup and the workers' start
    included), ``later`` (the epochs after the first), and ``first_s``, the first epoch's seconds with the setup."""
    from lightning_rec.data import TabularDataModule

    schema = {
        "labels": [{"column": "label"}],
        "dense": [{"column": f"int_{i}", "transform": "log1p"} for i in range(13)],
        "sparse": [{"column": f"cat_{i}", "ids": "hash", "num_embeddings": 1_000_000} for i in range(26)],
    }
    start = time.perf_counter()
    dm = TabularDataModule(
        schema=schema,
        train=[str(path)],
        val=[str(path)],
        stream=workers is not None,
        batch_size=batch_size,
        window=4,
        num_workers=workers or 0,
    )
    dm.setup("fit")
    train, val = dm.dataloader("train"), dm.dataloader("val")
    rows, first, first_rows = 0, 0.0, 0
    for epoch in range(epochs):
        train.set_epoch(epoch)  # as Lightning does, through sampler.set_epoch
        rows += sum(len(b.labels) for b in train)
        rows += sum(len(b.labels) for b in val)
        if epoch == 0:
            first, first_rows = time.perf_counter() - start, rows
    seconds = time.perf_counter() - start
    del train, val, dm  # the workers stop
    later = (rows - first_rows) / (seconds - first) if epochs > 1 else float("nan")
    return {"all": rows / seconds, "later": later, "first_s": first}


FIT_CONFIG = """\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 2
  strategy: recshard
  max_epochs: {epochs}
  default_root_dir: {root}
  enable_checkpointing: false
  logger: false
  enable_progress_bar: false
  num_sanity_val_steps: 0
model:
  class_path: lightning_rec.models.DLRMModule
  init_args:
    embedding_dim: 16
    dense_arch_layer_sizes: [32, 16]
    over_arch_layer_sizes: [32, 1]
data:
  class_path: lightning_rec.data.TabularDataModule
  init_args:
    train: [{path}]
    val: [{path}]
    stream: true
    batch_size: {batch_size}
    num_workers: {workers}
    schema:
      labels: [{{column: label}}]
      dense: [{dense}]
      sparse: [{sparse}]
"""


def time_fit(path: Path, batch_size: int, workers: int, epochs: int, directory: Path) -> float:
    """Seconds of one 2-rank ``lightning-rec fit`` streaming ``path`` with ``workers`` DataLoader workers per rank."""
    dense = ", ".join(f"{{column: int_{i}, transform: log1p}}" for i in range(4))
    sparse = ", ".join(f"{{column: cat_{i}, ids: hash, num_embeddings: 10000}}" for i in range(8))
    run = directory / f"fit_{workers}"
    config = directory / f"fit_{workers}.yaml"
    config.write_text(
        FIT_CONFIG.format(
            epochs=epochs, root=run, path=path, batch_size=batch_size, workers=workers, dense=dense, sparse=sparse
        )
    )
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "lightning_rec", "fit", "--config", str(config)], capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if out.returncode:
        raise RuntimeError(f"the fit with {workers} worker(s) failed:\n{out.stderr[-3000:]}")
    (run / "config.yaml").unlink(missing_ok=True)  # LightningCLI refuses to overwrite it in the next round
    return seconds


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=16_384)
    parser.add_argument("--formats", default="parquet,csv")
    parser.add_argument("--workers", default="", help="comma-separated worker counts: the loaders' comparison instead")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fit", default="", help="comma-separated worker counts: time 2-rank fits instead")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # "<parquet path>:<workers or mem>", internal
    args = parser.parse_args()
    if args.one:
        path, n = args.one.rsplit(":", 1)
        print(json.dumps(measure_workers(Path(path), args.batch_size, None if n == "mem" else int(n), args.epochs)))
        return
    if args.fit:
        seconds: dict[int, list[float]] = {int(n): [] for n in args.fit.split(",")}
        with tempfile.TemporaryDirectory() as tmp:
            path = write_tables(Path(tmp), args.rows)["parquet"]
            for _ in range(args.rounds):
                for n in seconds:
                    seconds[n].append(time_fit(path, args.batch_size, n, args.epochs, Path(tmp)))
                    print(f"2-rank fit, {n} worker(s) per rank: {seconds[n][-1]:.1f} s", flush=True)
        print(json.dumps({f"{n} workers": [round(s, 1) for s in runs] for n, runs in seconds.items()}))
        return
    if args.workers:
        counts: list[int | None] = [None, *map(int, args.workers.split(","))]
        names = {n: "in-memory" if n is None else f"stream, {n} worker(s)" for n in counts}
        runs: dict[str, list[dict[str, float]]] = {names[n]: [] for n in counts}
        with tempfile.TemporaryDirectory() as tmp:
            path = write_tables(Path(tmp), args.rows)["parquet"]
            for _ in range(args.rounds):
                for n in counts:  # a fresh process each, as a rank starts its workers (and their fork server) once
                    one = f"{path}:{'mem' if n is None else n}"
                    command = [sys.executable, __file__, "--one", one, "--batch-size", str(args.batch_size)]
                    out = subprocess.run([*command, "--epochs", str(args.epochs)], capture_output=True, text=True)
                    runs[names[n]].append(json.loads(out.stdout.strip().splitlines()[-1]))
                    r = runs[names[n]][-1]
                    print(
                        f"{names[n]:22s} {r['all']:>10,.0f} samples/s, {r['later']:>10,.0f} after the first epoch "
                        f"(first epoch {r['first_s']:.1f} s)",
                        flush=True,
                    )
        print(json.dumps({name: [{k: round(v, 1) for k, v in x.items()} for x in r] for name, r in runs.items()}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_tables(Path(tmp), args.rows)
        result = {fmt: measure(paths[fmt], args.batch_size) for fmt in args.formats.split(",")}
    for fmt, r in result.items():
        print(
            f"{fmt:8s} {r['samples_per_s']:>12,.0f} samples/s per worker ({r['workers_per_h100']:.1f} workers per H100 "
            f"at {H100_SAMPLES_PER_S:,.0f}/s); file {r['file_mb']:,.0f} MB, peak RSS growth {r['peak_rss_growth_mb']:,.0f} MB"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
