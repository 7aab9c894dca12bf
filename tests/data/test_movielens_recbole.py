"""MovieLensDataModule(protocol="recbole"): RecBole's context-aware quick-start, checked against RecBole itself.

The reference was printed by RecBole 1.2.1 in its own venv, with the quick-start's config and its default seed::

    /tmp/recbole-venv/bin/python benchmarks/recbole_quickstart.py --task context --split-only
    {"task": "context", "seed": 2020, "rows": {"train": 80000, "valid": 10000, "test": 10000},
     "test_rows_sha256": "f0c5f0f4...", "num": {"user_id": 944, "item_id": 1683, "timestamp": 1, "age": 62,
     "gender": 3, "occupation": 22, "release_year": 74, "class": 20}}
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec.data._movielens_files import _read, _vocab
from lightning_rec.data.movielens import MovieLensDataModule, load_interactions
from lightning_rec.models import LogisticRegression
from tests.helpers.data import movielens_dir

# printed by the command in the module docstring
RECBOLE_ROWS = {"train": 80000, "val": 10000, "test": 10000}
RECBOLE_TEST_SHA256 = "f0c5f0f4af3deff57a08f9f8a707f79d0bca40a11917f26c16ef81eaa7f647f7"
RECBOLE_NUM = {"user_id": 944, "age": 62, "gender": 3, "occupation": 22, "item_id": 1683, "release_year": 74}
RECBOLE_NUM["genres"] = 20  # RecBole's `class`


@pytest.fixture(scope="module")
def dm() -> MovieLensDataModule:
    module = MovieLensDataModule(str(movielens_dir()), download=False, protocol="recbole")
    module.split("train")  # drawn once for every test
    return module


def test_the_split_is_recboles_own(dm: MovieLensDataModule) -> None:
    root = movielens_dir()
    raw = _read(root)
    users = {i: u for u, i in _vocab(list(raw.users)).items()}
    items = {i: t for t, i in _vocab(list(raw.items)).items()}
    splits = {name: dm.split(name) for name in RECBOLE_ROWS}
    assert {name: len(s) for name, s in splits.items()} == RECBOLE_ROWS
    test = splits["test"]
    lines = sorted(f"{users[int(u)]}\t{items[int(i)]}" for u, i in zip(test.sparse["user_id"], test.sparse["item_id"]))
    assert hashlib.sha256("\n".join(lines).encode()).hexdigest() == RECBOLE_TEST_SHA256
    # Every rating in exactly one split (ml-100k has one rating per user and item), labelled rating >= 4.
    it = load_interactions(root)
    label = {(int(u), int(i)): float(r >= 4) for u, i, r in zip(it.user, it.item, it.rating)}
    seen = [
        (int(u), int(i), float(y))
        for s in splits.values()
        for u, i, y in zip(s.sparse["user_id"], s.sparse["item_id"], s.labels)
    ]
    assert len({(u, i) for u, i, _ in seen}) == len(seen) == len(label)
    assert all(label[(u, i)] == y for u, i, y in seen)


def test_features_are_recboles(dm: MovieLensDataModule) -> None:
    assert {f.name: f.num_embeddings for f in dm.sparse_features} == RECBOLE_NUM
    assert [f.name for f in dm.sparse_features if f.multi_hot] == ["genres"]
    assert dm.num_dense_features == 0 and dm.split("val").dense.shape == (10000, 0)
    batch = dm.split("test")[torch.arange(4)]
    assert batch.sparse_features.keys() == list(RECBOLE_NUM)
    # Age is the raw age (a token per value), not the project's 7 buckets.
    assert int(dm.split("train").sparse["age"].max()) == RECBOLE_NUM["age"] - 1


def test_more_features_on_request_and_the_project_default_unchanged() -> None:
    more = MovieLensDataModule(str(movielens_dir()), download=False, protocol="recbole", features=["user_id", "zip"])
    assert [f.name for f in more.sparse_features] == ["user_id", "zip"]
    project = MovieLensDataModule(str(movielens_dir()), download=False)
    assert [f.name for f in project.sparse_features] == [
        "user_id",
        "item_id",
        "age",
        "gender",
        "occupation",
        "zip",
        "genres",
    ]
    assert project.num_dense_features == 2 and (project.split_seed, len(project.split("train"))) == (42, 90000)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"protocol": "recbol"}, "protocol 'recbol' is not one of 'project', 'recbole'; did you mean 'recbole'?"),
        ({"protocol": "recbole", "test_fraction": 0.1}, "protocol='recbole' splits 80/10/10"),
        ({"protocol": "recbole", "features": ["zipp"]}, "feature 'zipp' is not one of protocol 'recbole'"),
        ({"features": ["release_year"]}, "feature 'release_year' is not one of protocol 'project'"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("?", r"\?")) as err:
        MovieLensDataModule("/nonexistent", download=False, **kwargs)  # refused before any file is read
    assert "\n" not in str(err.value)


def test_logistic_regression_is_bias_plus_the_values_weights() -> None:
    tables = [
        EmbeddingBagConfig(name="t_u", embedding_dim=1, num_embeddings=5, feature_names=["u"]),
        EmbeddingBagConfig(name="t_g", embedding_dim=1, num_embeddings=4, feature_names=["g"]),
    ]
    net = LogisticRegression(EmbeddingBagCollection(tables=tables), num_dense_features=1)
    with torch.no_grad():
        net.embedding_bag_collection.embedding_bags["t_u"].weight.copy_(torch.arange(5.0).unsqueeze(1))
        net.embedding_bag_collection.embedding_bags["t_g"].weight.copy_(10 * torch.arange(4.0).unsqueeze(1))
        net.bias.fill_(0.5)
        assert net.dense is not None
        net.dense.weight.fill_(2.0)
    # row 0: u=3, genres {1, 2}; row 1: u=1, genres {3}
    kjt = KeyedJaggedTensor.from_lengths_sync(["u", "g"], torch.tensor([3, 1, 1, 2, 3]), torch.tensor([1, 1, 2, 1]))
    logits = net(torch.tensor([[1.0], [-1.0]]), kjt)
    assert logits.tolist() == [[0.5 + 3 + 10 + 20 + 2.0], [0.5 + 1 + 30 - 2.0]]
    with pytest.raises(ValueError, match="embedding_dim 1"):
        LogisticRegression(
            EmbeddingBagCollection(
                tables=[EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=5, feature_names=["u"])]
            )
        )
