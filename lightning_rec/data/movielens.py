"""MovieLens-100K as a click-style task: does a user rate a movie 4 stars or more?

Either on-disk layout is read (GroupLens' ``u.data``/``u.user``/``u.item`` or RecBole's ``ml-100k.inter``/
``.user``/``.item``); :func:`~lightning_rec.data.prepare_movielens` fetches the files when neither is there (fetching,
checking and reading the files: ``lightning_rec/data/_movielens_files.py``).

Features of one sample (a rating)::

    sparse  user_id, item_id, age (7 buckets), gender, occupation, zip (first 3 characters),
            genres (multi-hot: 1 to 6 per movie -- a jagged feature)
    dense   release year (centred, /10), release year unknown (0/1)
    label   rating >= 4

``MovieLensDataModule(protocol="recbole")`` is RecBole's context-aware quick-start instead (see
:class:`MovieLensDataModule`): RecBole's features and its random 80/10/10 split of all ratings.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from lightning_rec._choices import check_choice, did_you_mean
from lightning_rec.config import SparseFeature
from lightning_rec.data._movielens_files import (
    _AGE_BOUNDARIES,
    _YEAR_CENTRE,
    _age_bucket,
    _atomic_rows,
    _find_layout,
    _read,
    _vocab,
    prepare_movielens,
)
from lightning_rec.data.base import Jagged, RecDataModule, RecDataset, _Column

__all__ = [
    "Interactions",
    "MovieLensDataModule",
    "Protocol",
    "load_interactions",
    "load_movielens",
    "recbole_split_ids",
]

_SPARSE_NAMES = ("user_id", "item_id", "age", "gender", "occupation", "zip", "genres")

Protocol = Literal["project", "recbole"]
"""Which evaluation protocol a MovieLens DataModule follows: this project's own (``"project"``, the default) or
RecBole's quick-start (``"recbole"``)."""

# RecBole's context-aware quick-start (docs/source/get_started/started/context-aware.rst): its `load_col` as this
# module names the columns (RecBole's `class` is `genres` here); age and release year are tokens there, one id per
# raw value (ml-100k.user `age:token`, ml-100k.item `release_year:token`), not buckets or a dense year.
_RECBOLE_FEATURES = ("user_id", "age", "gender", "occupation", "item_id", "release_year", "genres")
# What a user may add under protocol="recbole": the other column of RecBole's ml-100k.user (`zip_code`, first 3
# characters as in the project's features).
_RECBOLE_EXTRA = ("zip",)
_RECBOLE_RATIOS = (0.8, 0.1, 0.1)  # eval_args.split: {RS: [0.8, 0.1, 0.1]}, group_by: none, order: RO


@dataclass(frozen=True)
class Interactions:
    """Every rating of MovieLens-100K as columns, with the users' and movies' side features as lookup tables.

    Ids are those of :func:`load_movielens` (from 1 in sorted order; 0 is left for "unknown"), so a table built
    for one task fits the other. Retrieval and sequential tasks start here: order ratings by ``timestamp``
    per ``user`` for histories and leave-one-out splits.

    Attributes:
        user, item: ``(N,)`` long ids of each rating, in file order.
        rating: ``(N,)`` float stars (1 to 5).
        timestamp: ``(N,)`` long unix seconds.
        user_features: ``age``, ``gender``, ``occupation``, ``zip`` -> ``(num_users,)`` long ids indexed by user id.
        item_genres: the genre ids of each item id (a :class:`Jagged` of ``num_items`` rows; ``[0]`` when none).
        item_dense: ``(num_items, 2)`` float: release year (centred, /10) and "year unknown" (0/1), by item id.
        features: the sparse features of :func:`load_movielens` (table sizes).

    Example::

        >>> it = load_interactions("data/ml-100k")                           # doctest: +SKIP
        >>> it.num_users, it.num_items, len(it.user)                          # doctest: +SKIP
        (944, 1683, 100000)
    """

    user: torch.Tensor
    item: torch.Tensor
    rating: torch.Tensor
    timestamp: torch.Tensor
    user_features: dict[str, torch.Tensor]
    item_genres: Jagged
    item_dense: torch.Tensor
    features: list[SparseFeature]

    @property
    def num_users(self) -> int:
        """Rows of the user table (the largest user id + 1)."""
        return self.user_features["age"].numel()

    @property
    def num_items(self) -> int:
        """Rows of the item table (the largest item id + 1)."""
        return self.item_dense.shape[0]


def load_interactions(root: os.PathLike | str) -> Interactions:
    """Read MovieLens-100K from ``root`` (either layout) as :class:`Interactions`.

    Raises:
        FileNotFoundError: if ``root`` holds neither layout.
    """
    raw = _read(Path(root))
    user_ids, item_ids = _vocab(list(raw.users)), _vocab(list(raw.items))
    occupations = _vocab([u[2] for u in raw.users.values()])
    genders = _vocab([u[1] for u in raw.users.values()])
    zips = _vocab([u[3][:3] for u in raw.users.values()])
    genres = _vocab([g for _, gs in raw.items.values() for g in gs])

    user_features = {name: torch.zeros(len(user_ids) + 1, dtype=torch.long) for name in _SPARSE_NAMES[2:6]}
    for user, (age, gender, occupation, zipcode) in raw.users.items():
        uid = user_ids[user]
        user_features["age"][uid] = _age_bucket(age)
        user_features["gender"][uid] = genders.get(gender, 0)
        user_features["occupation"][uid] = occupations.get(occupation, 0)
        user_features["zip"][uid] = zips.get(zipcode[:3], 0)
    genre_rows: list[list[int]] = [[0] for _ in range(len(item_ids) + 1)]
    item_dense = [(0.0, 1.0)] * (len(item_ids) + 1)
    for item, (year, item_genres) in raw.items.items():
        genre_rows[item_ids[item]] = [genres[g] for g in item_genres] or [0]
        item_dense[item_ids[item]] = ((year - _YEAR_CENTRE) / 10.0, 0.0) if year is not None else (0.0, 1.0)

    sizes = {
        "user_id": len(user_ids) + 1,
        "item_id": len(item_ids) + 1,
        "age": len(_AGE_BOUNDARIES) + 2,
        "gender": len(genders) + 1,
        "occupation": len(occupations) + 1,
        "zip": len(zips) + 1,
        "genres": len(genres) + 1,
    }
    return Interactions(
        user=torch.tensor([user_ids.get(r[0], 0) for r in raw.ratings], dtype=torch.long),
        item=torch.tensor([item_ids.get(r[1], 0) for r in raw.ratings], dtype=torch.long),
        rating=torch.tensor([r[2] for r in raw.ratings], dtype=torch.float),
        timestamp=torch.tensor([r[3] for r in raw.ratings], dtype=torch.long),
        user_features=user_features,
        item_genres=Jagged.from_lists(genre_rows),
        item_dense=torch.tensor(item_dense),
        features=[SparseFeature(name, sizes[name], multi_hot=name == "genres") for name in _SPARSE_NAMES],
    )


def load_movielens(root: os.PathLike | str, positive_threshold: float = 4.0) -> tuple[RecDataset, list[SparseFeature]]:
    """Read MovieLens-100K from ``root`` (either layout) into one :class:`RecDataset` of all ratings.

    Args:
        root: a directory holding ``u.data/u.user/u.item`` or ``ml-100k.inter/.user/.item``.
        positive_threshold: ratings at or above it are positives (label 1).

    Returns:
        the dataset (one row per rating, in file order) and its sparse features (table sizes).

    Example::

        >>> ds, features = load_movielens("data/ml-100k")          # doctest: +SKIP
        >>> len(ds), [f.name for f in features]                      # doctest: +SKIP
        (100000, ['user_id', 'item_id', 'age', 'gender', 'occupation', 'zip', 'genres'])
    """
    it = load_interactions(root)
    return _ratings(it, positive_threshold), list(it.features)


def _ratings(it: Interactions, positive_threshold: float) -> RecDataset:
    """Every rating of ``it`` as a row of the click-style task (see the module docstring), in file order."""
    sparse: dict[str, _Column] = {"user_id": it.user, "item_id": it.item}
    sparse.update({name: column[it.user] for name, column in it.user_features.items()})
    values, lengths = it.item_genres.take(it.item)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=offsets[1:])
    sparse["genres"] = Jagged(values, offsets)
    labels = (it.rating >= positive_threshold).float()
    return RecDataset(it.item_dense[it.item], labels, sparse)


def _holdout_split(num_rows: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded random ``(keep, holdout)`` split of ``range(num_rows)``; both sorted.

    Example::

        >>> keep, held = _holdout_split(10, 0.2, seed=0)
        >>> len(keep), len(held), sorted(keep.tolist() + held.tolist()) == list(range(10))
        (8, 2, True)
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"holdout fraction must be in [0, 1), got {fraction}.")
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed))
    n_held = int(round(num_rows * fraction))
    return order[n_held:].sort().values, order[:n_held].sort().values


def recbole_split_ids(total: int, ratios: Sequence[float]) -> list[int]:
    """Where RecBole cuts ``total`` ordered rows into parts of ``ratios``: RecBole 1.2.1's
    ``Dataset._calcu_split_ids`` (``recbole/data/dataset/dataset.py``), line for line. Every part but the first is
    rounded down (``int(ratio * total)``), the first takes the rest; a part whose share is below one row but above
    zero gets one row, taken from the first. The ratios are normalised first, as ``Dataset.split_by_ratio`` does.

    Returns:
        the cumulative end of every part but the last (``len(ratios) - 1`` cut points).

    Example::

        >>> recbole_split_ids(100_000, [0.8, 0.1, 0.1]), recbole_split_ids(7, [0.8, 0.1, 0.1])
        ([80000, 90000], [5, 6])
    """
    ratios = [r / sum(ratios) for r in ratios]
    counts = [int(r * total) for r in ratios]
    counts[0] = total - sum(counts[1:])
    for i in range(1, len(ratios)):
        if counts[0] <= 1:
            break
        if 0 < ratios[-i] * total < 1:
            counts[-i] += 1
            counts[0] -= 1
    cuts, end = [], 0
    for count in counts[:-1]:
        end += count
        cuts.append(end)
    return cuts


def _recbole_ratings(
    root: Path, it: Interactions, positive_threshold: float, names: Sequence[str]
) -> tuple[RecDataset, list[SparseFeature]]:
    """Every rating of ``it`` as a row of RecBole's context-aware task, in file order: the sparse features ``names``
    (from ``_RECBOLE_FEATURES + _RECBOLE_EXTRA``), no dense features, label ``rating >= positive_threshold`` (RecBole's
    ``Dataset._set_label_by_threshold`` with ``threshold: {rating: 4}``).

    Age and release year are RecBole's tokens: one id per distinct raw string (RecBole's ``Dataset._remap``), 0
    for an empty one (RecBole's ``[PAD]``). With RecBole's atomic files that is the ``release_year`` column as
    written, its two odd values included (``unkonwn``, and ``V`` of item 1412): 73 tokens + ``[PAD]``, RecBole's
    ``dataset.num("release_year") == 74``; with GroupLens' files, the year of the release date. The other columns are :func:`load_interactions`'. Genres are summed by an ``EmbeddingBag`` as RecBole's
    first-order term sums a ``token_seq`` field (``FMFirstOrderLinear.embed_token_seq_fields``).
    """
    raw = _read(root)
    user_ids, item_ids = _vocab(list(raw.users)), _vocab(list(raw.items))
    ages = _vocab([str(u[0]) for u in raw.users.values()])
    if _find_layout(root) == "atomic":
        year_text = {r["item_id"]: r.get("release_year", "") for r in _atomic_rows(root / "ml-100k.item")}
    else:
        year_text = {item: "" if y is None else str(y) for item, (y, _) in raw.items.items()}
    years = _vocab([text for text in year_text.values() if text])
    age = torch.zeros(it.num_users, dtype=torch.long)
    for user, (years_old, *_) in raw.users.items():
        age[user_ids[user]] = ages[str(years_old)]
    year = torch.zeros(it.num_items, dtype=torch.long)
    for item, text in year_text.items():
        year[item_ids[item]] = years.get(text, 0)
    columns: dict[str, _Column] = {
        "user_id": it.user,
        "item_id": it.item,
        "age": age[it.user],
        "release_year": year[it.item],
    }
    columns.update({name: it.user_features[name][it.user] for name in ("gender", "occupation", "zip")})
    values, lengths = it.item_genres.take(it.item)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=offsets[1:])
    columns["genres"] = Jagged(values, offsets)
    sizes = {f.name: f.num_embeddings for f in it.features}
    sizes.update(age=len(ages) + 1, release_year=len(years) + 1)
    labels = (it.rating >= positive_threshold).float()
    data = RecDataset(torch.zeros(len(labels), 0), labels, {name: columns[name] for name in names})
    return data, [SparseFeature(name, sizes[name], multi_hot=name == "genres") for name in names]


class _MovieLensBase(RecDataModule):
    """What the MovieLens-100K DataModules share: where the data lives, fetching it (``prepare_data``) and reading it
    once (:attr:`interactions`). A task derives from it and overrides :meth:`~RecDataModule.split`.

    Args:
        data_dir: a directory with MovieLens-100K (either layout, see the module docstring); fetched there if absent
            and ``download``.
        download: fetch the data when ``data_dir`` lacks it (from the ``recbole==1.2.1`` wheel on PyPI).
        batch_size, num_workers, seed: see :class:`~lightning_rec.data.base.RecDataModule`.
    """

    def __init__(
        self,
        data_dir: str = "data/ml-100k",
        download: bool = True,
        batch_size: int = 512,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.data_dir = Path(data_dir)
        self.download = download
        self._interactions: Interactions | None = None

    def prepare_data(self) -> None:
        """Fetch the data into ``data_dir`` when it lacks it and ``download`` (once per machine: a lock file)."""
        if self.download:
            prepare_movielens(self.data_dir)

    @property
    def interactions(self) -> Interactions:
        """Every rating, with the users' and movies' features (read on first use, fetched first if need be)."""
        if self._interactions is None:
            self.prepare_data()
            self._interactions = load_interactions(self.data_dir)
        return self._interactions


class MovieLensDataModule(_MovieLensBase):
    """MovieLens-100K ratings as a binary task (rating >= 4), with sparse, multi-hot and dense features.

    ``protocol="project"`` (the default): the features of the module docstring; a seeded random 10% of the ratings
    held out for validation (and test, unless ``test_fraction`` carves a separate test holdout).

    ``protocol="recbole"``: RecBole's context-aware quick-start (``docs/source/get_started/started/
    context-aware.rst`` in RUCAIBox/RecBole, RecBole 1.2.1), so that numbers stand beside its published LR row:

    * features: RecBole's ``load_col`` -- ``user_id``, ``age``, ``gender``, ``occupation``, ``item_id``,
      ``release_year``, ``genres`` (RecBole's ``class``); age and release year are tokens (one id per raw value),
      as the atomic files declare them; no dense features (RecBole 1.2.1's context models embed a float field only
      when it is listed in ``numerical_features``, empty by default). ``features`` may add ``zip``.
    * label: ``rating >= positive_threshold`` (RecBole's ``threshold: {rating: 4}``, ``Dataset._set_label_by_threshold``).
    * split: every rating shuffled (``order: RO``, RecBole's ``Dataset.shuffle``; here a permutation seeded by
      ``split_seed``: RecBole's ``torch.randperm`` of the rows in file order right after ``init_seed``, so the
      default 2020, RecBole's default ``seed``, draws RecBole's own split) and cut 80/10/10 without grouping (``split: {RS: [0.8, 0.1, 0.1]}``, ``group_by: none``,
      ``Dataset.split_by_ratio``, cut points :func:`recbole_split_ids`: 80,000 / 10,000 / 10,000 rows). No user or
      item is filtered (ml-100k's quick-start sets no ``*_inter_num_interval``). ``val_fraction`` and
      ``test_fraction`` are this project's split; under ``"recbole"`` they must keep their defaults.

    ``predict`` runs over the validation rows.

    Args:
        data_dir: directory with either layout (see the module docstring); fetched there if absent and
            ``download`` is true.
        download: fetch the data when ``data_dir`` lacks it (from the ``recbole==1.2.1`` wheel on PyPI).
        val_fraction: share of ratings held out for validation (``protocol="project"``).
        test_fraction: share held out for test; 0 means test on the validation holdout (``protocol="project"``).
        split_seed: seed of the random holdout (fixed, so runs compare); ``None``: 42 under ``"project"``, 2020
            under ``"recbole"`` (RecBole's default ``seed``: its split).
        positive_threshold: ratings at or above it are positives.
        protocol: ``"project"`` or ``"recbole"`` (above).
        features: the sparse features to use, in this order; ``None``: the protocol's own (``"project"``: user_id,
            item_id, age, gender, occupation, zip, genres; ``"recbole"``: RecBole's set above).
        batch_size, num_workers, seed: see :class:`~lightning_rec.data.base.RecDataModule`.

    Example::

        dm = MovieLensDataModule("data/ml-100k", batch_size=1024)
        model = DLRMModule(sparse_features=dm.sparse_features, num_dense_features=dm.num_dense_features)
        L.Trainer(strategy="recshard", devices=2, max_epochs=4).fit(model, dm)

        recbole = MovieLensDataModule("data/ml-100k", protocol="recbole", batch_size=4096)
        [f.name for f in recbole.sparse_features]
        # ['user_id', 'age', 'gender', 'occupation', 'item_id', 'release_year', 'genres']
    """

    def __init__(
        self,
        data_dir: str = "data/ml-100k",
        download: bool = True,
        val_fraction: float = 0.1,
        test_fraction: float = 0.0,
        split_seed: int | None = None,
        positive_threshold: float = 4.0,
        batch_size: int = 512,
        num_workers: int = 0,
        seed: int = 0,
        protocol: Protocol = "project",
        features: list[str] | None = None,
    ) -> None:
        check_choice("MovieLensDataModule", "protocol", protocol, Protocol)
        if protocol == "recbole" and (val_fraction, test_fraction) != (0.1, 0.0):
            raise ValueError(
                f"MovieLensDataModule: protocol='recbole' splits 80/10/10 (RecBole's RS), so val_fraction and "
                f"test_fraction are not used; got val_fraction={val_fraction}, test_fraction={test_fraction}. "
                "HINT: leave them out, or use protocol='project'."
            )
        available = _SPARSE_NAMES if protocol == "project" else _RECBOLE_FEATURES + _RECBOLE_EXTRA
        for name in features or ():
            if name not in available:
                raise ValueError(
                    f"MovieLensDataModule: feature {name!r} is not one of protocol {protocol!r}'s "
                    f"{', '.join(map(repr, available))}{did_you_mean(name, available)}"
                )
        if features is not None and (not features or len(set(features)) != len(features)):
            raise ValueError(f"MovieLensDataModule: features must name distinct features, got {features}.")
        super().__init__(data_dir, download, batch_size=batch_size, num_workers=num_workers, seed=seed)
        if val_fraction + test_fraction >= 1.0:
            raise ValueError(f"val_fraction + test_fraction must be < 1, got {val_fraction} + {test_fraction}.")
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed if split_seed is not None else (42 if protocol == "project" else 2020)
        self.positive_threshold = positive_threshold
        self.protocol = protocol
        self.features = list(features or (_SPARSE_NAMES if protocol == "project" else _RECBOLE_FEATURES))
        self._splits: dict[str, RecDataset] = {}
        self._recbole_features: list[SparseFeature] | None = None

    @property
    def sparse_features(self) -> list[SparseFeature]:
        if self.protocol == "recbole":
            if self._recbole_features is None:
                self.split("train")
            assert self._recbole_features is not None  # set by split()
            return list(self._recbole_features)
        by_name = {f.name: f for f in self.interactions.features}
        return [by_name[name] for name in self.features]

    @property
    def num_dense_features(self) -> int:
        return 0 if self.protocol == "recbole" else 2

    def split(self, name: str) -> RecDataset:
        """The rows of split ``name`` (the holdout is drawn on first use); ``predict`` runs over the validation
        rows."""
        if not self._splits:
            if self.protocol == "recbole":
                self._splits = self._recbole_splits()
            else:
                data = _ratings(self.interactions, self.positive_threshold)
                if self.features != list(_SPARSE_NAMES):
                    data = RecDataset(data.dense, data.labels, {n: data.sparse[n] for n in self.features})
                rest, test = _holdout_split(len(data), self.test_fraction, self.split_seed + 1)
                train, val = _holdout_split(len(rest), self.val_fraction / (1.0 - self.test_fraction), self.split_seed)
                self._splits = {"train": data.subset(rest[train]), "val": data.subset(rest[val])}
                self._splits["test"] = data.subset(test) if len(test) else self._splits["val"]
        return self._splits["val" if name == "predict" else name]

    def _recbole_splits(self) -> dict[str, RecDataset]:
        """RecBole's ``Dataset.build`` for ``order: RO``, ``split: {RS: [0.8, 0.1, 0.1]}``, ``group_by: none``:
        shuffle every row, then cut at :func:`recbole_split_ids` (the rows keep the shuffled order, as RecBole's)."""
        self.prepare_data()
        data, self._recbole_features = _recbole_ratings(
            self.data_dir, self.interactions, self.positive_threshold, self.features
        )
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(self.split_seed))
        first, second = recbole_split_ids(len(data), _RECBOLE_RATIOS)
        return {
            "train": data.subset(order[:first]),
            "val": data.subset(order[first:second]),
            "test": data.subset(order[second:]),
        }
