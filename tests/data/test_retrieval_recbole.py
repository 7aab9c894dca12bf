"""MovieLensRetrievalDataModule(protocol="recbole"): RecBole's general-recommendation split and full-ranking rules.

The reference is RecBole itself: ``benchmarks/recbole_general_split.py`` ran RecBole 1.2.1's ``data_preparation``
with the BPR quick-start's settings (seed 2020) in its own venv and printed a digest of every user's training items
and, for its validation and test ``FullSortEvalDataLoader``, positives and excluded history::

    /tmp/recbole-venv/bin/python benchmarks/recbole_general_split.py --data-dir data/ml-100k
    {"seed": 2020, "rows": {"train": 80808, "val": 9596, "test": 9596}, "users": 943, "sha256": "00c855a8..."}
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.recbole_general_split import split_digest
from lightning_rec.data._movielens_files import _read, _vocab
from lightning_rec.data.movielens import load_interactions
from lightning_rec.data.movielens_retrieval import MovieLensRetrievalDataModule
from tests.helpers.data import movielens_dir

# printed by the command in the module docstring (RecBole 1.2.1, seed 2020)
RECBOLE_ROWS = {"train": 80808, "val": 9596, "test": 9596}
RECBOLE_SHA256 = "00c855a85c5e74c050fe31c3d664a8c91aefa51bdfa662a4b626acb784f52cd8"


@pytest.fixture(scope="module")
def dm() -> MovieLensRetrievalDataModule:
    module = MovieLensRetrievalDataModule(str(movielens_dir()), download=False, protocol="recbole", eval_batch_size=100)
    module.splits  # noqa: B018 (built once for every test)
    return module


def _rows(jagged) -> list[list[int]]:
    return [jagged.values[a:b].tolist() for a, b in zip(jagged.offsets[:-1].tolist(), jagged.offsets[1:].tolist())]


def _as_recbole(dm: MovieLensRetrievalDataModule) -> dict[str, list[list[str]]]:
    """Per raw user token: train items, val positives, val history, test positives, test history (raw tokens), as the
    module's rows and batches give them (history = the excluded ids but padding 0)."""
    raw = _read(movielens_dir())
    user_token = {i: u for u, i in _vocab(list(raw.users)).items()}
    item_token = {i: t for t, i in _vocab(list(raw.items)).items()}
    out: dict[str, list[list[str]]] = {}
    train = dm.split("train")
    for u, i in zip(train.user.tolist(), train.item.tolist()):
        out.setdefault(user_token[u], [[] for _ in range(5)])[0].append(item_token[i])
    for column, name in ((1, "val"), (3, "test")):
        rows = dm.split(name)
        batch = rows[torch.arange(len(rows))]
        positives = _rows_of(batch["positive_ids"], batch["positive_lengths"])
        excluded = _rows_of(batch["exclude_ids"], batch["exclude_lengths"])
        for u, pos, excl in zip(rows.user.tolist(), positives, excluded):
            assert excl[0] == 0 and 0 not in excl[1:] and 0 not in pos, "padding id 0 is excluded, once"
            entry = out.setdefault(user_token[u], [[] for _ in range(5)])
            entry[column] = [item_token[i] for i in pos]
            entry[column + 1] = [item_token[i] for i in excl[1:]]
    return out


def _rows_of(values: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    return [part.tolist() for part in values.split(lengths.tolist())]


def test_split_and_exclusions_are_recboles_own(dm: MovieLensRetrievalDataModule) -> None:
    rows = _as_recbole(dm)
    counts = {name: sum(len(r[c]) for r in rows.values()) for name, c in (("train", 0), ("val", 1), ("test", 3))}
    assert counts == RECBOLE_ROWS and len(rows) == 943
    assert split_digest(rows) == RECBOLE_SHA256


def test_every_rating_is_used_once_and_the_parts_follow_recboles_arithmetic(dm: MovieLensRetrievalDataModule) -> None:
    it = load_interactions(movielens_dir())
    by_user: dict[int, list[int]] = {}
    for u, i in zip(it.user.tolist(), it.item.tolist()):
        by_user.setdefault(u, []).append(i)
    parts = dm.splits.parts
    assert sorted(parts) == sorted(by_user)
    for u, items in by_user.items():
        train, val, test = parts[u]
        assert sorted(train + val + test) == sorted(items), u
        n = len(items)  # _calcu_split_ids: int(0.1 * n) for the last two parts, the first takes the rest
        assert (len(val), len(test)) == (int(0.1 * n), int(0.1 * n)), u
    assert {len(v) for v in by_user.values()} >= {20, 25}, "users whose counts round differently are in the data"
    # another seed is another split; the same seed the same one
    other = MovieLensRetrievalDataModule(str(movielens_dir()), download=False, protocol="recbole", split_seed=1)
    assert other.splits.parts[1] != parts[1] and sorted(sum(other.splits.parts[1], [])) == sorted(by_user[1])


def test_batches_and_features(dm: MovieLensRetrievalDataModule) -> None:
    assert [(f.name, f.num_embeddings) for f in dm.sparse_features] == [("user_id", 944), ("item_id", 1683)]
    train = dm.split("train")[torch.tensor([0, 5, 9])]
    assert train["query"].keys() == ["user_id"] and train["candidate"].keys() == ["item_id"]
    assert train["query"]["user_id"].values().tolist() == dm.split("train").user[[0, 5, 9]].tolist()
    assert torch.equal(train["query"].weights(), torch.ones(3)), "the query tower's collection is weighted"
    counts = torch.bincount(dm.split("train").item, minlength=1683).double()
    assert torch.allclose(train["candidate_log_q"].double(), (counts / counts.sum()).log()[train["candidate"].values()])
    test = dm.split("test")
    batch = test[torch.arange(3)]
    assert batch["candidate"]["item_id"].values().tolist() == list(range(1683))
    assert batch["positive_lengths"].tolist() == [len(set(dm.splits.parts[u][2])) for u in test.user[:3].tolist()]
    assert len(dm.split("val")) == len(test) == 943
    loader = dm.dataloader("test")
    assert sum(len(b["positive_lengths"]) for b in loader) == 943 and len(loader) == 10  # eval_batch_size 100


def test_bad_arguments_are_refused_in_one_line() -> None:
    data = str(movielens_dir())
    with pytest.raises(ValueError, match=r"protocol 'recbol' is not one of 'project', 'recbole'; did you mean"):
        MovieLensRetrievalDataModule(data, download=False, protocol="recbol")
    with pytest.raises(ValueError, match=r"protocol='recbole' uses every rating.*history_length.*HINT"):
        MovieLensRetrievalDataModule(data, download=False, protocol="recbole", history_length=10)
    with pytest.raises(ValueError, match=r"split_seed=3 seeds protocol='recbole'.*HINT"):
        MovieLensRetrievalDataModule(data, download=False, split_seed=3)
    project = MovieLensRetrievalDataModule(data, download=False)
    assert [f.name for f in project.sparse_features][-2:] == ["item_id", "genres"], "the default is unchanged"
