"""MovieLens-100K's files: where they come from, checking them, and reading them.

Two on-disk layouts of the same data are read:

* GroupLens' own release (``u.data``, ``u.user``, ``u.item``; https://grouplens.org/datasets/movielens/100k/),
* RecBole's atomic files (``ml-100k.inter``, ``ml-100k.user``, ``ml-100k.item``).

When neither is present, :func:`prepare_movielens` obtains the atomic files through the package registry
alone: the ``recbole==1.2.1`` wheel on PyPI ships them (``recbole/dataset_example/ml-100k/``). The wheel is
downloaded with pip (your pip configuration, index and proxy apply), never installed, checked against a
pinned SHA-256, and only those three files are extracted (each checked too). Nothing is fetched when the
files are already there. :func:`export_parquet` writes the ratings as a Parquet table for the schema path.

The features and DataModules built from these files: :mod:`lightning_rec.data.movielens`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["export_parquet", "prepare_movielens"]

_log = logging.getLogger(__name__)

_RECBOLE_WHEEL = "recbole-1.2.1-py3-none-any.whl"
_RECBOLE_WHEEL_SHA256 = "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"
_WHEEL_DIR = "recbole/dataset_example/ml-100k/"
_ATOMIC_FILES = {
    "ml-100k.inter": "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff",
    "ml-100k.user": "4f670007d9cfbeb9807e757209af1555b9bcc186bde25e767f67cb67c6dd5972",
    "ml-100k.item": "51d7cdf777ce5c0f5b32c1d947a4a81fe07d75e78abbe761e0cd4d0756064532",
}
_GROUPLENS_FILES = ("u.data", "u.user", "u.item")
# u.item's 19 genre flags, in GroupLens' order (u.genre).
_GROUPLENS_GENRES = (
    "unknown",
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
)
# MovieLens' own age groups (as in ml-1m): under 18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+.
_AGE_BOUNDARIES = (18, 25, 35, 45, 50, 56)
_YEAR_CENTRE = 1990.0


def _find_layout(root: Path) -> str | None:
    """``"grouplens"`` or ``"atomic"`` if ``root`` holds that layout's three files, else ``None``."""
    if all((root / f).is_file() for f in _GROUPLENS_FILES):
        return "grouplens"
    if all((root / f).is_file() for f in _ATOMIC_FILES):
        return "atomic"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock file, so ranks started together (torchrun) download once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare_movielens(root: os.PathLike | str, wheel: os.PathLike | str | None = None) -> Path:
    """Make sure ``root`` holds MovieLens-100K (either layout); fetch the atomic files if it does not.

    Args:
        root: the data directory.
        wheel: a ``recbole-1.2.1`` wheel already on disk to extract from, instead of downloading it.

    Returns:
        ``root`` as a ``Path``.

    Raises:
        RuntimeError: if the wheel cannot be downloaded or its checksum (or a file's) does not match.

    Example::

        prepare_movielens("data/ml-100k")     # downloads ~2 MB once; later calls return at once
    """
    root = Path(root)
    if _find_layout(root):
        return root
    with _locked(root.parent / f".{root.name}.lock"):
        if _find_layout(root):  # another process fetched it while we waited
            return root
        with tempfile.TemporaryDirectory(prefix="ml-100k-") as tmp:
            wheel_path = Path(wheel) if wheel is not None else _download_wheel(Path(tmp))
            if _sha256(wheel_path) != _RECBOLE_WHEEL_SHA256:
                raise RuntimeError(
                    f"{wheel_path} does not have the expected SHA-256 {_RECBOLE_WHEEL_SHA256}; refusing to use it. "
                    f"HINT: delete it, or download MovieLens-100K from GroupLens and pass its directory."
                )
            staging = Path(tmp) / "extracted"
            staging.mkdir()
            with zipfile.ZipFile(wheel_path) as zf:
                for name, sha in _ATOMIC_FILES.items():
                    target = staging / name
                    with zf.open(_WHEEL_DIR + name) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    if _sha256(target) != sha:
                        raise RuntimeError(f"{name} extracted from {wheel_path.name} has an unexpected SHA-256.")
            root.mkdir(parents=True, exist_ok=True)
            for name in _ATOMIC_FILES:  # each file appears whole or not at all
                os.replace(staging / name, root / name)
    _log.info("MovieLens-100K (atomic files) prepared in %s", root)
    return root


def _download_wheel(dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        "recbole==1.2.1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path = dest / _RECBOLE_WHEEL
    if proc.returncode != 0 or not path.is_file():
        raise RuntimeError(
            f"Could not download {_RECBOLE_WHEEL} from the package index ({' '.join(cmd)}):\n{proc.stderr[-2000:]}\n"
            "HINT: download MovieLens-100K (u.data, u.user, u.item) yourself and set data_dir to its directory."
        )
    return path


# ---------------------------------------------------------------------------------------------------------
# Reading both layouts into one raw form
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Raw:
    ratings: list[tuple[str, str, float, int]]  # (user, item, rating, unix timestamp)
    users: dict[str, tuple[int, str, str, str]]  # user -> (age, gender, occupation, zip)
    items: dict[str, tuple[int | None, list[str]]]  # item -> (release year, genres)


def _read_grouplens(root: Path) -> _Raw:
    ratings = []
    for line in (root / "u.data").read_text().splitlines():
        if line.strip():
            user, item, rating, timestamp = line.split("\t")
            ratings.append((user, item, float(rating), int(timestamp)))
    users = {}
    for line in (root / "u.user").read_text().splitlines():
        if line.strip():
            user, age, gender, occupation, zipcode = line.split("|")
            users[user] = (int(age), gender, occupation, zipcode)
    items = {}
    for line in (root / "u.item").read_text(encoding="latin-1").splitlines():
        if line.strip():
            fields = line.split("|")
            date, flags = fields[2], fields[5:]
            year = int(date[-4:]) if len(date) >= 4 and date[-4:].isdigit() else None
            items[fields[0]] = (year, [g for g, flag in zip(_GROUPLENS_GENRES, flags) if flag == "1"])
    return _Raw(ratings, users, items)


def _atomic_rows(path: Path) -> Iterator[dict[str, str]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    header = [h.split(":")[0] for h in lines[0].split("\t")]
    for line in lines[1:]:
        if line.strip():
            yield dict(zip(header, line.split("\t")))


def _read_atomic(root: Path) -> _Raw:
    ratings = [
        (r["user_id"], r["item_id"], float(r["rating"]), int(float(r["timestamp"])))
        for r in _atomic_rows(root / "ml-100k.inter")
    ]
    users = {
        r["user_id"]: (int(r["age"]), r["gender"], r["occupation"], r["zip_code"])
        for r in _atomic_rows(root / "ml-100k.user")
    }
    items = {}
    for r in _atomic_rows(root / "ml-100k.item"):
        year = r.get("release_year", "")
        items[r["item_id"]] = (int(year) if year.isdigit() else None, r.get("class", "").split())
    return _Raw(ratings, users, items)


def _read(root: Path) -> _Raw:
    """The raw ratings, users and items of ``root``, whichever layout it holds.

    Raises:
        FileNotFoundError: if ``root`` holds neither layout.
    """
    layout = _find_layout(root)
    if layout is None:
        raise FileNotFoundError(
            f"{root} holds neither {', '.join(_GROUPLENS_FILES)} (GroupLens) nor {', '.join(_ATOMIC_FILES)} (atomic "
            "files). HINT: call prepare_movielens(root) or set download=True."
        )
    return _read_grouplens(root) if layout == "grouplens" else _read_atomic(root)


def _vocab(values: Sequence[str]) -> dict[str, int]:
    """Sorted distinct values -> ids from 1; id 0 is left for values never seen (e.g. a rating's unknown user)."""
    return {v: i + 1 for i, v in enumerate(sorted(set(values)))}


def _age_bucket(age: int) -> int:
    return 1 + sum(age >= b for b in _AGE_BOUNDARIES)


def export_parquet(root: os.PathLike | str, output: os.PathLike | str | None = None) -> Path:
    """Write MovieLens-100K (either layout in ``root``) as one Parquet table of its ratings, as a warehouse export
    would hold it, plus a vocabulary file per categorical column, for :class:`~lightning_rec.data.TabularDataModule`
    (``examples/configs/movielens_parquet.yaml``).

    Columns, one row per rating in file order: ``user_id``, ``item_id`` (text), ``rating`` (float), ``timestamp``,
    ``age_group`` (MovieLens-1M's age groups: 1, 18, 25, 35, 45, 50, 56), ``gender``, ``occupation``, ``zip3`` (the
    zip code's first 3 characters), ``genres`` (a list of text), ``release_year`` (1990 where unknown) and
    ``release_year_unknown`` (0/1). The vocabulary files (``vocab_<column>.txt`` next to the table) list each
    column's values in the order :func:`~lightning_rec.data.movielens.load_movielens` numbers them, so the schema
    path gives the same ids.

    Args:
        root: the MovieLens directory (fetched there if missing, see :func:`prepare_movielens`).
        output: the Parquet file (default: ``<root>/ml-100k.parquet``).

    Returns:
        the Parquet file's path.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = prepare_movielens(root)
    raw = _read(root)
    out = Path(output) if output is not None else root / "ml-100k.parquet"
    out.parent.mkdir(parents=True, exist_ok=True)
    groups = (1,) + _AGE_BOUNDARIES
    users = [raw.users[r[0]] for r in raw.ratings]
    items = [raw.items.get(r[1], (None, [])) for r in raw.ratings]
    table = pa.table(
        {
            "user_id": [r[0] for r in raw.ratings],
            "item_id": [r[1] for r in raw.ratings],
            "rating": pa.array([r[2] for r in raw.ratings], pa.float32()),
            "timestamp": pa.array([r[3] for r in raw.ratings], pa.int64()),
            "age_group": pa.array([groups[_age_bucket(u[0]) - 1] for u in users], pa.int64()),
            "gender": [u[1] for u in users],
            "occupation": [u[2] for u in users],
            "zip3": [u[3][:3] for u in users],
            "genres": pa.array([list(i[1]) or [""] for i in items], pa.list_(pa.string())),
            "release_year": pa.array([float(i[0]) if i[0] is not None else _YEAR_CENTRE for i in items]),
            "release_year_unknown": pa.array([0.0 if i[0] is not None else 1.0 for i in items]),
        }
    )
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(table, tmp, row_group_size=25_000)
    os.replace(tmp, out)  # whole or not at all
    vocabularies = {
        "user_id": sorted(raw.users),
        "item_id": sorted(raw.items),
        "age_group": [str(g) for g in groups],
        "gender": sorted({u[1] for u in raw.users.values()}),
        "occupation": sorted({u[2] for u in raw.users.values()}),
        "zip3": sorted({u[3][:3] for u in raw.users.values()}),
        "genres": sorted({g for _, gs in raw.items.values() for g in gs}),
    }
    for column, values in vocabularies.items():
        (out.parent / f"vocab_{column}.txt").write_text("".join(f"{v}\n" for v in values), encoding="utf-8")
    return out
