"""How fast TabularDataModule streams a Criteo-shaped table, per DataLoader worker, and how much memory it holds.

A Criteo-like table (a label, 13 integer columns, 26 categorical columns as 8-hex-digit text, like Criteo's) is
written as Parquet (row groups of 131,072 rows) and as CSV; the schema hashes every categorical column into 1M rows
and log1p-transforms the integers (the DLRM preprocessing). One process, no DataLoader worker (``num_workers=0``
is what one worker does): batches of 16,384 rows, as in the GPU bench, are built and counted; samples/s is rows /
wall time. Peak RSS growth is measured while streaming, against the file's size::

    .venv/bin/python benchmarks/tabular_throughput.py --rows 1000000     # ~2 min on 2 cores (writes ~0.4 GB in /tmp)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=16_384)
    parser.add_argument("--formats", default="parquet,csv")
    args = parser.parse_args()
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
