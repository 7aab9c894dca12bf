"""RecBole's own quick-starts on MovieLens-100K, run offline: the "RecBole run offline" column of the parity table
(docs/model-quality.md, issue 48).

``--task`` picks one of RecBole's three quick-start pages (``docs/source/get_started/started/*.rst`` in
RUCAIBox/RecBole), whose "Quick-start From Source" ``test.yaml`` is copied below verbatim (:data:`QUICKSTART`):

* ``general``: BPR, embedding 64, per-user random 80/10/10, full ranking (published: recall@10 0.2523, ...);
* ``sequential``: GRU4Rec, embedding 64, hidden 128, time-ordered leave-one-out, full ranking (hit@10 0.1103, ...);
* ``context``: LR, embedding 10, rating >= 4, random 80/10/10 (AUC 0.7765, log loss 0.5620).

Only what running offline on this machine needs is added (:data:`OFFLINE`): the data directory (the project's
``data/ml-100k`` atomic files, the ones RecBole downloads), CPU, no progress bars, checkpoints in a temporary
directory. The seed is RecBole's default (2020, ``reproducibility: True``) unless ``--seed`` says otherwise, and the
run is RecBole's ``run_recbole`` path (``init_seed``, ``create_dataset``, ``data_preparation``, ``init_seed``, the
model, ``Trainer.fit`` with its early stopping, ``Trainer.evaluate`` of the best epoch). ``--epochs`` overrides the
quick-start's 500 (RecBole stops early after 10 epochs without a better validation score anyway).

RecBole does not install next to this project (it needs ``numpy<2`` and ``pandas<2``); use a venv of its own,
outside the repo::

    python3.11 -m venv /tmp/recbole-venv
    /tmp/recbole-venv/bin/pip install "recbole==1.2.1" "numpy<2" "setuptools<81" "pandas<2" "torch==2.13.0"
    /tmp/recbole-venv/bin/python benchmarks/recbole_quickstart.py --task context [--data-dir data/ml-100k]

Prints one JSON line: the task, model, seed, the best validation and the test numbers (RecBole's keys:
``recall@10``, ``auc``, ``logloss``, ...), the epochs run, the best epoch, the rows per split, a SHA-256 of the test
split's (user, item) pairs (raw ids, sorted: the same split drawn by lightning_rec gives the same digest, see
``lightning_rec.data.MovieLensDataModule(protocol="recbole")``) and the wall time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

# The "Quick-start From Source" test.yaml of each page, as printed there (RecBole @ v1.2.1 and later).
QUICKSTART: dict[str, dict[str, Any]] = {
    "general": {
        "model": "BPR",
        "page": "docs/source/get_started/started/general.rst",
        "config": {
            "USER_ID_FIELD": "user_id",
            "ITEM_ID_FIELD": "item_id",
            "load_col": {"inter": ["user_id", "item_id"]},
            "embedding_size": 64,
            "epochs": 500,
            "train_batch_size": 4096,
            "eval_batch_size": 4096,
            "train_neg_sample_args": {
                "distribution": "uniform",
                "sample_num": 1,
                "alpha": 1.0,
                "dynamic": False,
                "candidate_num": 0,
            },
            "eval_args": {"group_by": "user", "order": "RO", "split": {"RS": [0.8, 0.1, 0.1]}, "mode": "full"},
            "metrics": ["Recall", "MRR", "NDCG", "Hit", "Precision"],
            "topk": 10,
            "valid_metric": "MRR@10",
            "metric_decimal_place": 4,
        },
    },
    "sequential": {
        "model": "GRU4Rec",
        "page": "docs/source/get_started/started/sequential.rst",
        "config": {
            "USER_ID_FIELD": "user_id",
            "ITEM_ID_FIELD": "item_id",
            "TIME_FIELD": "timestamp",
            "load_col": {"inter": ["user_id", "item_id", "timestamp"]},
            "ITEM_LIST_LENGTH_FIELD": "item_length",
            "LIST_SUFFIX": "_list",
            "MAX_ITEM_LIST_LENGTH": 50,
            "embedding_size": 64,
            "hidden_size": 128,
            "num_layers": 1,
            "dropout_prob": 0.3,
            "loss_type": "CE",
            "epochs": 500,
            "train_batch_size": 4096,
            "eval_batch_size": 4096,
            "train_neg_sample_args": None,
            "eval_args": {"group_by": "user", "order": "TO", "split": {"LS": "valid_and_test"}, "mode": "full"},
            "metrics": ["Recall", "MRR", "NDCG", "Hit", "Precision"],
            "topk": 10,
            "valid_metric": "MRR@10",
            "metric_decimal_place": 4,
        },
    },
    "context": {
        "model": "LR",
        "page": "docs/source/get_started/started/context-aware.rst",
        "config": {
            "load_col": {
                "inter": ["user_id", "item_id", "rating", "timestamp"],
                "user": ["user_id", "age", "gender", "occupation"],
                "item": ["item_id", "release_year", "class"],
            },
            "threshold": {"rating": 4},
            "embedding_size": 10,
            "epochs": 500,
            "train_batch_size": 4096,
            "eval_batch_size": 4096,
            "eval_args": {"split": {"RS": [0.8, 0.1, 0.1]}, "order": "RO", "group_by": None, "mode": "labeled"},
            "train_neg_sample_args": None,
            "metrics": ["AUC", "LogLoss"],
            "valid_metric": "AUC",
        },
    },
}

# What running offline on this machine adds (nothing that changes the model, the data or the protocol).
OFFLINE = {"device": "cpu", "use_gpu": False, "show_progress": False, "reproducibility": True}


class _BestEpoch(logging.Handler):
    """Reads RecBole's "Finished training, best eval result in epoch N" and counts its "epoch N training" lines."""

    def __init__(self) -> None:
        super().__init__()
        self.best_epoch: int | None = None
        self.epochs = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if re.search(r"epoch \d+ training", message):
            self.epochs += 1
        match = re.search(r"best eval result in epoch (\d+)", message)
        if match:
            self.best_epoch = int(match.group(1))


def _test_rows_sha256(dataset: Any) -> str:
    """SHA-256 of the sorted raw ``user_id<TAB>item_id`` lines of ``dataset``'s interactions."""
    users = dataset.id2token("user_id", dataset.inter_feat["user_id"].numpy())
    items = dataset.id2token("item_id", dataset.inter_feat["item_id"].numpy())
    lines = sorted(f"{u}\t{i}" for u, i in zip(users, items))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=sorted(QUICKSTART))
    parser.add_argument("--data-dir", default="data/ml-100k", help="directory holding ml-100k.inter/.user/.item")
    parser.add_argument("--seed", type=int, default=2020, help="RecBole's default seed")
    parser.add_argument("--epochs", type=int, default=None, help="override the quick-start's 500 epochs")
    parser.add_argument(
        "--split-only",
        action="store_true",
        help="no training: print the split (rows, test digest) and each field's number of ids (RecBole's num)",
    )
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
    from recbole.utils import get_model, get_trainer, init_logger, init_seed

    quick = QUICKSTART[args.task]
    workdir = tempfile.mkdtemp(prefix=f"recbole-{args.task}-")
    os.chdir(workdir)  # RecBole writes log/ and saved/ into the working directory
    config_dict = dict(quick["config"], **OFFLINE, seed=args.seed)
    config_dict.update(data_path=str(data_dir.parent), checkpoint_dir=os.path.join(workdir, "saved"))
    if args.epochs is not None:
        config_dict["epochs"] = args.epochs
    config = Config(model=quick["model"], dataset="ml-100k", config_dict=config_dict)
    # recbole.quick_start.run_recbole, step for step.
    init_seed(config["seed"], config["reproducibility"])
    init_logger(config)
    progress = _BestEpoch()
    logging.getLogger().addHandler(progress)
    dataset = create_dataset(config)
    train_data, valid_data, test_data = data_preparation(config, dataset)
    rows = {"train": len(train_data.dataset), "valid": len(valid_data.dataset), "test": len(test_data.dataset)}
    if args.split_only:
        fields = {f: int(dataset.num(f)) for f in dataset.field2type if f != config["LABEL_FIELD"]}
        split = {"rows": rows, "test_rows_sha256": _test_rows_sha256(test_data.dataset), "num": fields}
        print(json.dumps({"task": args.task, "seed": args.seed, **split}))
        return
    init_seed(config["seed"] + config["local_rank"], config["reproducibility"])
    model = get_model(config["model"])(config, train_data._dataset).to(config["device"])
    trainer = get_trainer(config["MODEL_TYPE"], config["model"])(config, model)
    fit_start = time.perf_counter()
    _, best_valid = trainer.fit(train_data, valid_data, saved=True, show_progress=False)
    fit_s = time.perf_counter() - fit_start
    test = trainer.evaluate(test_data, load_best_model=True, show_progress=False)
    print(
        json.dumps(
            {
                "task": args.task,
                "model": f"recbole {quick['model']}",
                "page": quick["page"],
                "seed": args.seed,
                "epochs_run": progress.epochs,
                "best_epoch": progress.best_epoch,
                "best_valid": {k: round(float(v), 4) for k, v in best_valid.items()},
                "test": {k: round(float(v), 4) for k, v in test.items()},
                "rows": rows,
                "test_rows_sha256": _test_rows_sha256(test_data.dataset),
                "fit_s": round(fit_s, 1),
                "total_s": round(time.perf_counter() - start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
