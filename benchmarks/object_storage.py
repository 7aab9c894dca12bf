"""Streamed rows/s from a local S3 server against the same files on local disk, in the same run.

The Criteo-shaped table of ``benchmarks/tabular_throughput.py`` (a label, 13 integer columns, 26 categorical
columns as 8-hex-digit text; Parquet in row groups of 131,072 rows, and CSV) is written to a temporary folder and
uploaded to moto's S3 server on loopback (``lightning_rec.testing.object_storage.LocalS3``, its own process); a
TabularDataModule streams the training split (``stream: true``; every categorical column hashed into 1M rows, the
integers log1p-transformed) from the disk path and from the ``s3://`` URL, in turn (alternating which goes first),
``--rounds`` times; rows/s is the rows of one pass over its wall time (the DataModule's setup, which lists the
units, left out), the median of the rounds. The result is the ratio S3 / disk per format and worker count (the
issue's bar: >= 0.9)::

    .venv/bin/python benchmarks/object_storage.py --rows 100000 --rounds 6 --workers 0,2    # ~8 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from tabular_throughput import write_tables  # beside this script (its folder is sys.path[0]): the same table

SCHEMA = {
    "labels": [{"column": "label"}],
    "dense": [{"column": f"int_{i}", "transform": "log1p"} for i in range(13)],
    "sparse": [{"column": f"cat_{i}", "ids": "hash", "num_embeddings": 1_000_000} for i in range(26)],
}


def rows_per_s(source: str, batch_size: int, workers: int) -> float:
    """Rows/s of one streamed training pass over ``source`` (a path or a URL) with ``workers`` DataLoader workers."""
    from lightning_rec.data import TabularDataModule

    dm = TabularDataModule(
        schema=SCHEMA, train=[source], stream=True, batch_size=batch_size, window=4, num_workers=workers
    )
    dm.setup("fit")
    loader = dm.dataloader("train")
    start = time.perf_counter()
    rows = sum(len(b.labels) for b in loader)
    seconds = time.perf_counter() - start
    del loader, dm  # its workers stop
    return rows / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--batch-size", type=int, default=16_384)
    parser.add_argument("--formats", default="parquet,csv")
    parser.add_argument("--workers", default="0", help="comma-separated DataLoader worker counts")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from lightning_rec.testing.object_storage import LocalS3, aws_env

    results = []
    with tempfile.TemporaryDirectory() as tmp, LocalS3() as s3:
        tables = write_tables(Path(tmp), args.rows)
        s3.upload("bench", {path.name: path for path in tables.values()})
        with aws_env(s3.endpoint, "bench", "bench"):  # moto serves anyone until auth is enforced
            for fmt in args.formats.split(","):
                for workers in (int(w) for w in args.workers.split(",")):
                    disk, remote = [], []
                    for i in range(args.rounds):  # interleaved, in turn first (ABBA): both see the same load
                        order = [(disk, str(tables[fmt])), (remote, f"s3://bench/{tables[fmt].name}")]
                        for results_, source in order if i % 2 == 0 else order[::-1]:
                            results_.append(rows_per_s(source, args.batch_size, workers))
                    row = {
                        "format": fmt,
                        "workers": workers,
                        "disk_rows_per_s": statistics.median(disk),
                        "s3_rows_per_s": statistics.median(remote),
                        "ratio": statistics.median(remote) / statistics.median(disk),
                        "rounds": args.rounds,
                        "rows": args.rows,
                    }
                    results.append(row)
                    print(json.dumps(row), flush=True)
    print("format   workers  disk rows/s  s3 rows/s  s3/disk")
    for r in results:
        print(
            f"{r['format']:8} {r['workers']:7d} {r['disk_rows_per_s']:12,.0f} {r['s3_rows_per_s']:10,.0f} "
            f"{r['ratio']:8.2f}"
        )


if __name__ == "__main__":
    main()
