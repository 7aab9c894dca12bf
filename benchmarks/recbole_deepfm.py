"""RecBole's DeepFM on MovieLens-100K: the reference for ``examples/configs/movielens_deepfm.yaml`` (issue 15).

The same atomic files as the shipped config (``data/ml-100k``), rating >= 4 positive, a random 80/10/10 split
(RecBole's ``RS: [0.8, 0.1, 0.1]``, ``order: RO``, ``mode: labeled``), AUC and log loss, 20 epochs, the best
epoch chosen on validation AUC (RecBole's own early stopping left at its default patience). Features are
RecBole's ``context-aware_ml-100k`` quick-start set: user id, age, gender, occupation; item id, release year,
genres (``class``); ``--with-zip`` adds the users' zip code (lightning_rec's MovieLens features have it).
RecBole's DeepFM defaults otherwise (embedding 10, MLP [128, 128, 128], dropout 0.2, Adam lr 0.001, batch 2048).
One CPU process.

RecBole does not install next to this project (it needs ``numpy<2``; and ``pandas<2``: with pandas 3 it fails
remapping the ``class`` genre lists); use a venv of its own, outside the repo::

    python3.11 -m venv /tmp/recbole-venv
    /tmp/recbole-venv/bin/pip install "recbole==1.2.1" "numpy<2" "setuptools<81" "pandas<2" "torch==2.13.0"
    /tmp/recbole-venv/bin/python benchmarks/recbole_deepfm.py --data-dir data/ml-100k [--with-zip]

Prints one JSON line: best validation AUC and log loss, the test AUC and log loss of that epoch's model, the
validation AUC per epoch, and the wall time (``fit_s``: training + validation; ``total_s``: with data loading).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path


class _ValidAUC(logging.Handler):
    """Collects RecBole's per-epoch "valid result: auc : 0.7xx" log lines."""

    def __init__(self) -> None:
        super().__init__()
        self.aucs: list = []

    def emit(self, record: logging.LogRecord) -> None:
        match = re.search(r"valid result:\s*\n?\s*auc\s*:\s*([0-9.]+)", record.getMessage(), re.IGNORECASE)
        if match:
            self.aucs.append(round(float(match.group(1)), 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="data/ml-100k", help="directory holding ml-100k.inter/.user/.item")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=2020, help="RecBole's default seed")
    parser.add_argument("--with-zip", action="store_true", help="also the users' zip_code (lightning_rec's features)")
    args = parser.parse_args()

    data_dir = Path(args.data_dir).resolve()
    if not (data_dir / "ml-100k.inter").is_file():
        raise SystemExit(
            f"{data_dir} has no ml-100k.inter. HINT: run `lightning-rec prepare movielens` (atomic files) first,"
            f" or pass --data-dir; got --data-dir={args.data_dir!r}."
        )
    # RecBole 1.2.1 reloads its own best checkpoint (written by this run) with torch.load, which torch >= 2.6
    # refuses by default (weights_only); the file is this script's own, so allow it.
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    start = time.perf_counter()
    from recbole.config import Config
    from recbole.data import create_dataset, data_preparation
    from recbole.model.context_aware_recommender import DeepFM
    from recbole.trainer import Trainer
    from recbole.utils import init_logger, init_seed

    workdir = tempfile.mkdtemp(prefix="recbole-deepfm-")
    os.chdir(workdir)  # RecBole writes log/ and saved/ into the working directory
    config = Config(
        model="DeepFM",
        dataset="ml-100k",
        config_dict={
            "data_path": str(data_dir.parent),
            "checkpoint_dir": os.path.join(workdir, "saved"),
            "device": "cpu",
            "use_gpu": False,
            "seed": args.seed,
            "reproducibility": True,
            "show_progress": False,
            "threshold": {"rating": 4},
            "load_col": {
                "inter": ["user_id", "item_id", "rating", "timestamp"],
                "user": ["user_id", "age", "gender", "occupation"] + (["zip_code"] if args.with_zip else []),
                "item": ["item_id", "release_year", "class"],
            },
            "eval_args": {"split": {"RS": [0.8, 0.1, 0.1]}, "order": "RO", "group_by": None, "mode": "labeled"},
            "train_neg_sample_args": None,
            "metrics": ["AUC", "LogLoss"],
            "valid_metric": "AUC",
            "epochs": args.epochs,
        },
    )
    init_seed(config["seed"], config["reproducibility"])
    init_logger(config)
    collector = _ValidAUC()
    logging.getLogger().addHandler(collector)
    dataset = create_dataset(config)
    train_data, valid_data, test_data = data_preparation(config, dataset)
    init_seed(config["seed"], config["reproducibility"])
    model = DeepFM(config, train_data._dataset).to(config["device"])
    trainer = Trainer(config, model)
    fit_start = time.perf_counter()
    _, best_valid = trainer.fit(train_data, valid_data, saved=True, show_progress=False)
    fit_s = time.perf_counter() - fit_start
    test = trainer.evaluate(test_data, load_best_model=True, show_progress=False)
    rows = {"train": len(train_data.dataset), "valid": len(valid_data.dataset), "test": len(test_data.dataset)}
    print(
        json.dumps(
            {
                "model": "recbole DeepFM",
                "epochs": args.epochs,
                "with_zip": args.with_zip,
                "rows": rows,
                "best_valid_auc": round(float(best_valid["auc"]), 4),
                "best_valid_logloss": round(float(best_valid["logloss"]), 4),
                "test_auc": round(float(test["auc"]), 4),
                "test_logloss": round(float(test["logloss"]), 4),
                "valid_auc_per_epoch": collector.aucs,
                "fit_s": round(fit_s, 1),
                "total_s": round(time.perf_counter() - start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
