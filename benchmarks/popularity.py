"""The popularity baseline of the retrieval task (issue 15): every item ranked by its number of training positives
(ties: lower id first), the user's training items (and at test, the validation item) excluded, exactly as
:class:`~lightning_rec.models.TwoTowerModule` is evaluated on the leave-one-out split of
:class:`~lightning_rec.data.MovieLensRetrievalDataModule`. Prints one JSON line per split.

    .venv/bin/python benchmarks/popularity.py [--data-dir data/ml-100k] [--ks 10 50]
"""

from __future__ import annotations

import argparse
import json

from lightning_rec.data.movielens_retrieval import MovieLensRetrievalDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="data/ml-100k")
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--positive-threshold", type=float, default=4.0)
    args = parser.parse_args()
    dm = MovieLensRetrievalDataModule(args.data_dir, positive_threshold=args.positive_threshold)
    for split in ("val", "test"):
        print(json.dumps({k: round(v, 4) for k, v in dm.popularity_baseline(split, args.ks).items()}))


if __name__ == "__main__":
    main()
