"""MovieLens-100K: fetching (checksums, no re-download), both layouts, features, split."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from lightning_rec.data import _movielens_files
from lightning_rec.data._movielens_files import _GROUPLENS_GENRES, prepare_movielens
from lightning_rec.data.base import rank_batches
from lightning_rec.data.movielens import MovieLensDataModule, _holdout_split, load_movielens
from tests.helpers.data import movielens_dir


@pytest.fixture(scope="module")
def ml_dir() -> Path:
    return movielens_dir()


def test_prepare_fetches_checked_files_once(ml_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, sha in _movielens_files._ATOMIC_FILES.items():
        assert _movielens_files._sha256(ml_dir / name) == sha
    # Present data is never fetched again.
    monkeypatch.setattr(
        _movielens_files, "_download_wheel", lambda dest: pytest.fail("downloaded data already present")
    )
    assert prepare_movielens(ml_dir) == ml_dir


def test_prepare_refuses_a_wheel_with_the_wrong_checksum(tmp_path: Path) -> None:
    fake = tmp_path / _movielens_files._RECBOLE_WHEEL
    with zipfile.ZipFile(fake, "w") as zf:
        for name in _movielens_files._ATOMIC_FILES:
            zf.writestr(_movielens_files._WHEEL_DIR + name, "user_id:token\n1\n")
    target = tmp_path / "ml"
    with pytest.raises(RuntimeError, match="SHA-256"):
        prepare_movielens(target, wheel=fake)
    assert not target.exists() or not any(target.iterdir()), "a rejected wheel left files behind"


def test_missing_data_without_download_names_the_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"u\.data.*ml-100k\.inter"):
        load_movielens(tmp_path)


def _write_grouplens(src: Path, dst: Path) -> None:
    """The same data in GroupLens' layout (what a user who downloaded it from grouplens.org has)."""
    dst.mkdir()
    rows = lambda name: [l.split("\t") for l in (src / name).read_text().splitlines()[1:] if l.strip()]  # noqa: E731
    (dst / "u.data").write_text("".join("\t".join(r) + "\n" for r in rows("ml-100k.inter")))
    (dst / "u.user").write_text("".join("|".join(r) + "\n" for r in rows("ml-100k.user")))
    lines = []
    for item, title, year, genres in rows("ml-100k.item"):
        date = f"01-Jan-{year}" if year else ""
        flags = ["1" if g in genres.split() else "0" for g in _GROUPLENS_GENRES]
        lines.append("|".join([item, title, date, "", "http://example"] + flags))
    (dst / "u.item").write_bytes("\n".join(lines).encode("latin-1", errors="replace") + b"\n")


def test_grouplens_and_atomic_layouts_give_the_same_dataset(ml_dir: Path, tmp_path: Path) -> None:
    _write_grouplens(ml_dir, tmp_path / "gl")
    a, fa = load_movielens(ml_dir)
    g, fg = load_movielens(tmp_path / "gl")
    assert fa == fg
    idx = torch.arange(len(a))
    ba, bg = a[idx], g[idx]
    assert torch.equal(ba.labels, bg.labels) and torch.equal(ba.dense_features, bg.dense_features)
    assert torch.equal(ba.sparse_features.values(), bg.sparse_features.values())
    assert torch.equal(ba.sparse_features.lengths(), bg.sparse_features.lengths())


def test_features_of_real_data(ml_dir: Path) -> None:
    ds, features = load_movielens(ml_dir)
    assert len(ds) == 100_000
    sizes = {f.name: f.num_embeddings for f in features}
    assert sizes["user_id"] == 944 and sizes["item_id"] == 1683  # 943 users, 1682 movies, + id 0 for unknown
    assert [f.name for f in features if f.multi_hot] == ["genres"]
    # rating >= 4: 55.4% of MovieLens-100K ratings
    assert abs(ds.labels.mean().item() - 0.5537) < 1e-3
    kjt = ds[torch.arange(len(ds))].sparse_features.to_dict()
    for f in features:
        ids = kjt[f.name].values()
        assert ids.min() >= 0 and ids.max() < f.num_embeddings, f.name
    genre_lengths = kjt["genres"].lengths()
    assert genre_lengths.min() == 1 and genre_lengths.max() == 6  # jagged: 1 to 6 genres per movie
    # first rating in the file: user 196 rates item 242 "3" -> negative; Kolya (1996) is a comedy
    first = ds[0]
    assert first.labels.item() == 0.0
    assert torch.allclose(first.dense_features, torch.tensor([[(1996 - 1990) / 10, 0.0]]))
    genre_names = sorted({g for g in _GROUPLENS_GENRES if g != "unknown"} | {"unknown"})
    assert first.sparse_features["genres"].values().tolist() == [genre_names.index("Comedy") + 1]


def test_holdout_is_seeded_disjoint_and_complete() -> None:
    keep, held = _holdout_split(100_000, 0.1, seed=42)
    assert len(held) == 10_000 and len(keep) == 90_000
    assert torch.equal(torch.sort(torch.cat([keep, held])).values, torch.arange(100_000))
    assert torch.equal(held, _holdout_split(100_000, 0.1, seed=42)[1])
    assert not torch.equal(held, _holdout_split(100_000, 0.1, seed=43)[1])


def test_datamodule_splits_and_rank_loaders(ml_dir: Path) -> None:
    dm = MovieLensDataModule(str(ml_dir), batch_size=1000)
    dm.setup("fit")
    assert len(dm.split("train")) == 90_000 and len(dm.split("val")) == 10_000
    assert dm.split("test") is dm.split("val")
    dm_test = MovieLensDataModule(str(ml_dir), val_fraction=0.1, test_fraction=0.1)
    dm_test.setup("test")
    assert [len(dm_test.split(s)) for s in ("train", "val", "test")] == [80_000, 10_000, 10_000]
    # Two ranks' validation batches: equal counts, every row once.
    per_rank = [rank_batches(10_000, 1000, rank=r, world_size=2) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])
    assert torch.equal(torch.sort(torch.cat([b for bs in per_rank for b in bs])).values, torch.arange(10_000))
