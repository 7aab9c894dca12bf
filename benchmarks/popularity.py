"""Popularity baselines of the model zoo's three MovieLens-100K tasks (issue 15), each evaluated exactly as its model:

* ``ctr``: a rating's score is its item's share of positives among the item's training ratings (add-one smoothed),
  AUROC on the validation and test rows of :class:`~lightning_rec.data.MovieLensDataModule` with the DeepFM config's
  80/10/10 split and the main job's 90/10 split;
* ``retrieval``: every item ranked by its number of training positives (ties: lower id first), the user's training
  items (and at test, the validation item) excluded, on the leave-one-out split of
  :class:`~lightning_rec.data.MovieLensRetrievalDataModule` (recall@k, NDCG@k);
* ``sequential``: the same ranking by training interactions on :class:`~lightning_rec.data.MovieLensSequenceDataModule`
  (HR@k, NDCG@k).

Prints one JSON line per task and split::

    .venv/bin/python benchmarks/popularity.py [ctr retrieval sequential] [--data-dir data/ml-100k]
"""

from __future__ import annotations

import argparse
import json

import torch
from torchmetrics.classification import BinaryAUROC

from lightning_rec.data import MovieLensDataModule, MovieLensRetrievalDataModule, MovieLensSequenceDataModule
from lightning_rec.data.movielens_retrieval import popularity_baseline as retrieval_baseline
from lightning_rec.data.movielens_sequential import popularity_baseline as sequential_baseline


def ctr_baseline(data_dir: str, val_fraction: float, test_fraction: float) -> dict[str, float]:
    """AUROC of the items' smoothed training positive rate on the validation (and test) rows."""
    dm = MovieLensDataModule(data_dir, download=False, val_fraction=val_fraction, test_fraction=test_fraction)
    dm.setup("fit")
    item_index = [f.name for f in dm.sparse_features].index("item_id")
    num_items = dm.sparse_features[item_index].num_embeddings

    def items_and_labels(split: str):
        data = dm.split(split)
        return data.sparse["item_id"], data.labels

    train_items, train_labels = items_and_labels("train")
    positives = torch.zeros(num_items).index_add_(0, train_items, train_labels)
    counts = torch.zeros(num_items).index_add_(0, train_items, torch.ones_like(train_labels))
    rate = (positives + 1) / (counts + 2)
    out = {}
    for split in ("val", "test") if test_fraction else ("val",):
        items, labels = items_and_labels(split)
        out[f"{split}/auroc"] = round(float(BinaryAUROC()(rate[items], labels.long())), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tasks", nargs="*", default=["ctr", "retrieval", "sequential"])
    parser.add_argument("--data-dir", default="data/ml-100k")
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 50])
    args = parser.parse_args()
    if "ctr" in args.tasks:
        print(json.dumps({"task": "ctr", "split": "80/10/10 (DeepFM)", **ctr_baseline(args.data_dir, 0.1, 0.1)}))
        print(json.dumps({"task": "ctr", "split": "90/10 (main job)", **ctr_baseline(args.data_dir, 0.1, 0.0)}))
    if "retrieval" in args.tasks:
        splits = MovieLensRetrievalDataModule(args.data_dir).splits
        for split in ("val", "test"):
            metrics = retrieval_baseline(splits, split, args.ks)
            print(json.dumps({"task": "retrieval", **{k: round(v, 4) for k, v in metrics.items()}}))
    if "sequential" in args.tasks:
        sequences = MovieLensSequenceDataModule(args.data_dir).splits
        metrics = {k: v for split in ("val", "test") for k, v in sequential_baseline(sequences, split, args.ks).items()}
        print(json.dumps({"task": "sequential", **{k: round(v, 4) for k, v in metrics.items()}}))


if __name__ == "__main__":
    main()
