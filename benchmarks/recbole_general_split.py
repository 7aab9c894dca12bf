"""RecBole's own general-recommendation split of MovieLens-100K, as a digest: the reference of
``MovieLensRetrievalDataModule(protocol="recbole")`` (``tests/data/test_retrieval_recbole.py`` compares its digest
with the one this script printed).

Runs RecBole 1.2.1's ``data_preparation`` with the BPR quick-start's data and evaluation settings
(``docs/source/get_started/started/general.rst``: ``load_col: {inter: [user_id, item_id]}``, ``eval_args: {group_by:
user, order: RO, split: {RS: [0.8, 0.1, 0.1]}, mode: full}``) after ``init_seed(seed)``, and reads back, per user
(raw tokens): the training items, and for the validation and test ``FullSortEvalDataLoader`` the positives
(``uid2positive_item``) and the excluded history (``uid2history_item``). Prints one JSON line: the row counts and
the SHA-256 of the canonical JSON of those lists (:func:`split_digest`, shared with the test).

RecBole needs a venv of its own (see ``benchmarks/recbole_deepfm.py``)::

    /tmp/recbole-venv/bin/python benchmarks/recbole_general_split.py --data-dir data/ml-100k [--seed 2020]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path


def split_digest(rows: Mapping[str, Sequence[Iterable[str]]]) -> str:
    """SHA-256 of ``[[user, train, val positives, val history, test positives, test history], ...]`` (users in
    numeric order, every list of raw item tokens sorted numerically) as compact JSON."""
    canonical = [[user, *(sorted(items, key=int) for items in rows[user])] for user in sorted(rows, key=int)]
    return hashlib.sha256(json.dumps(canonical, separators=(",", ":")).encode()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="data/ml-100k", help="directory holding ml-100k.inter")
    parser.add_argument("--seed", type=int, default=2020, help="RecBole's default seed")
    args = parser.parse_args()
    data_dir = Path(args.data_dir).resolve()
    if not (data_dir / "ml-100k.inter").is_file():
        raise SystemExit(f"{data_dir} has no ml-100k.inter. HINT: run `lightning-rec prepare movielens` first.")

    from recbole.config import Config
    from recbole.data import create_dataset, data_preparation
    from recbole.utils import init_seed

    with tempfile.TemporaryDirectory() as work:
        config = Config(
            model="BPR",
            dataset="ml-100k",
            config_dict={
                "USER_ID_FIELD": "user_id",
                "ITEM_ID_FIELD": "item_id",
                "load_col": {"inter": ["user_id", "item_id"]},
                "eval_args": {"group_by": "user", "order": "RO", "split": {"RS": [0.8, 0.1, 0.1]}, "mode": "full"},
                "data_path": str(data_dir.parent),
                "checkpoint_dir": work,
                "seed": args.seed,
                "use_gpu": False,
                "show_progress": False,
            },
        )
        init_seed(config["seed"], config["reproducibility"])
        dataset = create_dataset(config)
        train, valid, test = data_preparation(config, dataset)
    user_token, item_token = dataset.field2id_token["user_id"], dataset.field2id_token["item_id"]
    rows: dict[str, list[list[str]]] = {}
    for u, i in zip(train._dataset.inter_feat["user_id"].tolist(), train._dataset.inter_feat["item_id"].tolist()):
        rows.setdefault(str(user_token[u]), [[] for _ in range(5)])[0].append(str(item_token[i]))
    for column, loader in ((1, valid), (3, test)):
        for u in range(1, len(user_token)):
            entry = rows.setdefault(str(user_token[u]), [[] for _ in range(5)])
            for offset, table in ((0, loader.uid2positive_item), (1, loader.uid2history_item)):
                if table[u] is not None:
                    entry[column + offset] = [str(item_token[i]) for i in table[u].tolist()]
    counts = {name: sum(len(r[c]) for r in rows.values()) for name, c in (("train", 0), ("val", 1), ("test", 3))}
    print(json.dumps({"seed": args.seed, "rows": counts, "users": len(rows), "sha256": split_digest(rows)}))


if __name__ == "__main__":
    main()
