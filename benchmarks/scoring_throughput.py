"""Scoring a file against training on it: rows/s of ``lightning-rec predict --output`` and of ``lightning-rec fit``
on the same 1M-row Parquet file, 2 CPU ranks, in the same run (issue 44, item 7: a file scores at no less than
training's rows/s).

A click log (``user_id`` hashed into 200,000 rows, ``item_id`` text hashed into 50,000, 4 dense columns, a label;
``keys: [user_id, item_id]``) is written as Parquet; DLRM (embedding_dim 16) trains one epoch on it (recshard, 2 CPU
processes, no validation), then the checkpoint scores the same file to ``scores.parquet``. Both commands run with
:class:`LoopTimer` among their callbacks: rows/s is rank 0's rows times the world size (ranks' batches differ by at
most one row) over the loop's time from the end of its first batch (start-up excluded, as the progress bar's
samples/s); for scoring also to the end of ``predict`` (the scores merged in row order and written: what a user
waits for). The batch size is the same for both (``--batch-size``)::

    .venv/bin/python benchmarks/scoring_throughput.py --rows 1000000 --batch-size 8192

prints one JSON line: ``train_rows_per_s``, ``predict_rows_per_s`` (the loop), ``score_rows_per_s`` (the loop and the
file written) and their ratios to training's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np


class LoopTimer(pl.Callback):
    """Rank 0 writes ``{stage: {"rows", "loop_s", "end_s"}}`` to ``path``: rows after the first batch (times the
    world size) and the seconds from the end of the first batch to the end of the last (``loop_s``) and to the end
    of the stage (``end_s``; for ``predict``, after every writer)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._start: float | None = None
        self._rows = 0
        self._last = 0.0

    def _batch(self, trainer: pl.Trainer, batch: Any) -> None:
        now = time.perf_counter()
        if self._start is None:
            self._start = now
        else:
            self._rows += int(batch.labels.shape[0]) * trainer.world_size
        self._last = now

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
        self._batch(trainer, batch)

    def on_predict_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int, *a: Any
    ) -> None:
        self._batch(trainer, batch)

    def _write(self, trainer: pl.Trainer, stage: str) -> None:
        if trainer.global_rank != 0 or self._start is None:
            return
        end = time.perf_counter() - self._start
        record = {"rows": self._rows, "loop_s": self._last - self._start, "end_s": end}
        with open(self.path, "w") as f:
            json.dump({stage: record}, f)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._write(trainer, "train")

    def on_predict_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._write(trainer, "predict")


def write_log(path: Path, rows: int, seed: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    writer = None
    for start in range(0, rows, 131_072):
        n = min(131_072, rows - start)
        users = rng.zipf(1.2, n) % 1_000_000
        items = rng.zipf(1.3, n) % 100_000
        cols: dict[str, Any] = {
            "user_id": pa.array(users.astype(np.int64)),
            "item_id": pa.array(np.char.mod("i%d", items)),
            "clicked": pa.array((rng.random(n) < 0.25).astype(np.float32)),
        }
        for i in range(4):
            cols[f"f{i}"] = pa.array(rng.gamma(2.0, 2.0, n).astype(np.float32))
        table = pa.table(cols)
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    assert writer is not None
    writer.close()


def config(tmp: Path, batch_size: int) -> dict[str, Any]:
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": "recshard",
            "max_epochs": 1,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "logger": False,
            "default_root_dir": str(tmp / "fit"),
        },
        "model": {"class_path": "lightning_rec.models.DLRMModule", "init_args": {"embedding_dim": 16}},
        "data": {
            "class_path": "lightning_rec.data.TabularDataModule",
            "init_args": {
                "train": str(tmp / "clicks.parquet"),
                "val": str(tmp / "clicks.parquet"),
                "batch_size": batch_size,
                "schema": {
                    "labels": [{"column": "clicked"}],
                    "keys": ["user_id", "item_id"],
                    "dense": [{"column": f"f{i}", "transform": "log1p"} for i in range(4)],
                    "sparse": [
                        {"column": "user_id", "ids": "hash", "num_embeddings": 200_000},
                        {"column": "item_id", "ids": "hash", "num_embeddings": 50_000},
                    ],
                },
            },
        },
    }


def run(args: list[str], tmp: Path, timing: Path) -> dict[str, Any]:
    script = str(Path(sys.executable).with_name("lightning-rec"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    timer = ["--trainer.callbacks+=scoring_throughput.LoopTimer", f"--trainer.callbacks.path={timing}"]
    started = time.perf_counter()
    out = subprocess.run([script, *args, *timer], cwd=tmp, capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-4000:])
    record = json.loads(timing.read_text())
    return {**next(iter(record.values())), "command_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=8192)
    args = parser.parse_args()
    import yaml

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        write_log(tmp / "clicks.parquet", args.rows)
        (tmp / "c.yaml").write_text(yaml.safe_dump(config(tmp, args.batch_size)))
        train = run(["fit", "--config", "c.yaml"], tmp, tmp / "train.json")
        [ckpt] = sorted((tmp / "fit").rglob("*.ckpt"))
        predict = run(
            [
                "predict",
                "--config",
                "c.yaml",
                f"--ckpt_path={ckpt}",
                "--data.predict_files=clicks.parquet",
                "--output=scores.parquet",
                f"--trainer.default_root_dir={tmp / 'predict'}",
            ],
            tmp,
            tmp / "predict.json",
        )
        import pyarrow.parquet as pq

        written = pq.read_metadata(tmp / "scores.parquet").num_rows
    train_rate = train["rows"] / train["loop_s"]
    predict_rate = predict["rows"] / predict["loop_s"]
    score_rate = predict["rows"] / predict["end_s"]
    print(
        json.dumps(
            {
                "rows": args.rows,
                "batch_size": args.batch_size,
                "rows_written": written,
                "train_rows_per_s": round(train_rate),
                "predict_rows_per_s": round(predict_rate),
                "score_rows_per_s": round(score_rate),
                "predict_over_train": round(predict_rate / train_rate, 2),
                "score_over_train": round(score_rate / train_rate, 2),
                "fit_command_s": round(train["command_s"], 1),
                "predict_command_s": round(predict["command_s"], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
