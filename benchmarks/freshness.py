"""Fresh beats stale (issue 47): MovieLens-100K replayed in timestamp order, week by week, with progressive
evaluation (each week scored before it is trained on), for

(a) the model updated every week, and
(b) the same model (same seed, same weeks, so the same numbers up to the half) frozen after the first half of the
    weeks: it keeps being scored, but trains no more (its ``training_step`` returns ``None`` from then on).

Prints each week's progressive AUROC side by side and the mean over the second half. One rank, a small DLRM, one
pass over the ratings (the label: rating >= 4); about a minute per run on 2 CPU cores.

Run:
    python benchmarks/freshness.py [--data data/ml-100k] [--period week] [--batch-size 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L

import lightning_rec
from lightning_rec import EmbeddingOptimizer, ProgressiveEvaluation
from lightning_rec.data import TabularDataModule, export_parquet
from lightning_rec.models import DLRMModule

SCHEMA = {
    "labels": [{"column": "rating", "threshold": 4.0}],
    "dense": [
        {"column": "release_year", "transform": "standardize", "mean": 1990.0, "std": 10.0},
        {"column": "release_year_unknown"},
    ],
    "sparse": [
        {"column": "user_id", "ids": "vocab"},
        {"column": "item_id", "ids": "vocab"},
        {"column": "age_group", "name": "age", "ids": "vocab"},
        {"column": "gender", "ids": "vocab"},
        {"column": "occupation", "ids": "vocab"},
        {"column": "genres", "ids": "vocab", "list": True},
    ],
}


class FreezableDLRM(DLRMModule):
    """A DLRM that stops training at the epoch's batch ``frozen_from`` (``None``: never): from there its
    ``training_step`` returns ``None``, so Lightning runs no backward and no optimizer step for the batch (the fused
    embedding update runs in the backward: no update at all), while callbacks still see every batch."""

    frozen_from: int | None = None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.frozen_from is not None and batch_idx >= self.frozen_from:
            return None
        return super().training_step(batch, batch_idx)


def run(parquet: Path, period: str, batch_size: int, frozen_after: int | None, seed: int) -> dict[str, Any]:
    """One pass over the ratings in time order; ``frozen_after``: the number of periods trained before freezing."""
    dm = TabularDataModule(
        schema=SCHEMA, train=[str(parquet)], stream=True, period=period, time_column="timestamp", batch_size=batch_size
    )
    L.seed_everything(seed, verbose=False)
    model = FreezableDLRM(
        sparse_features=dm.sparse_features,
        num_dense_features=dm.num_dense_features,
        embedding_dim=16,
        dense_arch_layer_sizes=[32, 16],
        over_arch_layer_sizes=[32, 1],
        embedding_optimizer=EmbeddingOptimizer("rowwise_adagrad", lr=0.05),
        dense_optimizer="adam",
        dense_lr=3e-3,
    )
    periods = dm.periods
    if frozen_after is not None:
        model.frozen_from = periods[frozen_after].first_batch
    progressive = ProgressiveEvaluation()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=lightning_rec.RecShardStrategy(),
        max_epochs=1,
        limit_val_batches=0,
        callbacks=[progressive],
        logger=False,
        default_root_dir=parquet.parent,  # a preempted run's checkpoint goes there, not into the working directory
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(model, dm)
    return {"seconds": time.perf_counter() - start, "history": progressive.history}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/ml-100k", help="MovieLens-100K (either layout; fetched if missing)")
    parser.add_argument("--period", default="week", choices=["hour", "day", "week"])
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        parquet = export_parquet(args.data, Path(tmp) / "ml-100k.parquet")
        count = len(
            TabularDataModule(
                schema=SCHEMA, train=[str(parquet)], stream=True, period=args.period, time_column="timestamp"
            ).periods
        )
        half = count // 2
        fresh = run(parquet, args.period, args.batch_size, None, args.seed)
        stale = run(parquet, args.period, args.batch_size, half, args.seed)
    rows = []
    print(f"{'period':>6}  {'start':<10}  {'rows':>5}  {'fresh AUROC':>11}  {'stale AUROC':>11}  {'fresh - stale':>13}")
    for a, b in zip(fresh["history"], stale["history"]):
        mark = "  (frozen)" if a["period"] >= half else ""
        print(
            f"{a['period']:>6}  {str(a['start'])[:10]:<10}  {a['rows']:>5}  {a['auroc']:>11.4f}  {b['auroc']:>11.4f}  "
            f"{a['auroc'] - b['auroc']:>+13.4f}{mark}"
        )
        rows.append({"period": a["period"], "start": a["start"], "rows": a["rows"], "fresh": a, "stale": b})
    second = [r for r in rows if r["period"] >= half]

    def mean(key: str, which: str) -> float:
        return sum(r[which][key] for r in second) / len(second)

    summary = {key: {"fresh": mean(key, "fresh"), "stale": mean(key, "stale")} for key in ("auroc", "ne", "log_loss")}
    wins = sum(r["fresh"]["auroc"] > r["stale"]["auroc"] for r in second)
    print(
        f"second half ({len(second)} {args.period}s from period {half}): mean AUROC fresh {summary['auroc']['fresh']:.4f}"
        f" vs stale {summary['auroc']['stale']:.4f} ({summary['auroc']['fresh'] - summary['auroc']['stale']:+.4f}); "
        f"NE {summary['ne']['fresh']:.4f} vs {summary['ne']['stale']:.4f}; log loss {summary['log_loss']['fresh']:.4f}"
        f" vs {summary['log_loss']['stale']:.4f}; fresh better in {wins} of {len(second)} {args.period}s. Runs: "
        f"{fresh['seconds']:.0f} s and {stale['seconds']:.0f} s."
    )
    out = {"period": args.period, "periods": count, "half": half, "rows": rows, "second_half": summary, "wins": wins}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
