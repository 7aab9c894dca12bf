"""Real data for tests, fetched once per checkout into data/ (git-ignored) and shared by every test."""

from __future__ import annotations

from pathlib import Path

from lightning_rec.data._movielens_files import prepare_movielens

REPO = Path(__file__).resolve().parents[2]
MOVIELENS_DIR = REPO / "data" / "ml-100k"


def movielens_dir() -> Path:
    """MovieLens-100K atomic files (from the recbole wheel on PyPI the first time; checksums verified)."""
    return prepare_movielens(MOVIELENS_DIR)
