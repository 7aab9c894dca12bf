"""TabularDataModule: Parquet and CSV through a declared schema. MovieLens-100K exported as Parquet gives the
built-in DataModule's batches exactly; ids map stably; what the training split teaches is kept in checkpoints; bad
data is refused before training, named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from lightning_rec.data import DataError, MovieLensDataModule, TabularDataModule
from lightning_rec.data._movielens_files import export_parquet
from lightning_rec.data.schema import Vocabulary, hash_ids
from lightning_rec.models.dlrm import table_configs
from tests.helpers.data import movielens_dir

REPO = Path(__file__).resolve().parents[2]


def _parquet_config(tmp: Path) -> dict[str, Any]:
    """examples/configs/movielens_parquet.yaml's data arguments, pointed at a fresh export in ``tmp``."""
    export_parquet(movielens_dir(), tmp / "ml-100k.parquet")
    args = yaml.safe_load((REPO / "examples/configs/movielens_parquet.yaml").read_text())["data"]["init_args"]
    text = json.dumps(args).replace("data/ml-100k/", f"{tmp}/")
    return json.loads(text)


def _same_batches(a: Any, b: Any) -> None:
    idx = torch.arange(len(b))
    x, y = a[idx], b[idx]
    assert x.sparse_features.keys() == y.sparse_features.keys()
    assert torch.equal(x.sparse_features.values(), y.sparse_features.values())
    assert torch.equal(x.sparse_features.lengths(), y.sparse_features.lengths())
    assert torch.equal(x.dense_features, y.dense_features) and torch.equal(x.labels, y.labels)


def test_movielens_as_parquet_gives_the_built_in_batches(tmp_path: Path) -> None:
    tab = TabularDataModule(**_parquet_config(tmp_path))
    ml = MovieLensDataModule(str(movielens_dir()), val_fraction=0.1, test_fraction=0.1, split_seed=42, batch_size=1024)
    tab.setup("fit")
    ml.setup("fit")
    assert tab.sparse_features == ml.sparse_features and tab.num_dense_features == ml.num_dense_features == 2
    for split in ("train", "val", "test"):
        _same_batches(tab.split(split), ml.split(split))
    assert len(tab.split("train")) == 80_000


def test_the_same_table_as_csv_reads_the_same(tmp_path: Path) -> None:
    config = _parquet_config(tmp_path)
    table = pq.read_table(tmp_path / "ml-100k.parquet")
    genres = pa.array(["|".join(g) for g in table.column("genres").to_pylist()])
    csv = tmp_path / "ml.csv"
    pacsv.write_csv(table.set_column(table.column_names.index("genres"), "genres", genres), csv)
    parquet = TabularDataModule(**config)
    from_csv = TabularDataModule(**{**config, "files": [str(csv)]})
    parquet.setup("fit")
    from_csv.setup("fit")
    for split in ("train", "val"):
        _same_batches(from_csv.split(split), parquet.split(split))


def _clicks(tmp: Path, rows: dict[str, Any], name: str = "clicks.parquet", **kw: Any) -> Path:
    path = tmp / name
    pq.write_table(pa.table(rows), path, **kw)
    return path


SCHEMA = {
    "labels": [{"column": "click"}],
    "dense": [{"column": "price", "transform": "standardize"}],
    "sparse": [
        {"column": "user", "ids": "hash", "num_embeddings": 1000},
        {"column": "item", "ids": "vocab"},
        {"column": "history", "ids": "vocab", "list": True, "table": "item"},
    ],
}


def _rows(n: int = 40) -> dict[str, Any]:
    return {
        "click": [float(i % 2) for i in range(n)],
        "price": [float(i) for i in range(n)],
        "user": [f"u{i % 7}" for i in range(n)],
        "item": [f"i{i % 5}" for i in range(n)],
        "history": [[f"i{(i + k) % 6}" for k in range(i % 3)] for i in range(n)],
        "day": list(range(n)),
    }


def test_vocab_and_statistics_come_from_the_training_split_and_travel_in_the_state_dict(tmp_path: Path) -> None:
    path = _clicks(tmp_path, _rows())
    dm = TabularDataModule(
        schema=SCHEMA,
        files=[str(path)],
        split={"timestamp": {"column": "day", "val_from": 30}},
        state_dir=str(tmp_path / "state"),
    )
    dm.setup("fit")
    assert len(dm.split("train")) == 30 and len(dm.split("val")) == 10
    # One vocabulary for the table item and history share, from both features' training values, by count.
    vocab = dm.vocabularies["item"].values
    assert sorted(vocab) == ["i0", "i1", "i2", "i3", "i4", "i5"] and vocab[-1] == "i5", "i5: history only, rarest"
    features = {f.name: f for f in dm.sparse_features}
    assert (
        features["history"].table == "item"
        and features["item"].num_embeddings == 7 == features["history"].num_embeddings
    )
    train = dm.split("train")[torch.arange(30)].sparse_features.to_dict()
    first = dm.vocabularies["item"].rows(np.array(["i1"]))[0]
    assert train["item"].values()[1] == first and train["history"].values()[0] == first, "i1 is one row in both"
    [table] = [t for t in table_configs(dm.sparse_features, 4) if t.name == "t_item"]
    assert table.feature_names == ["item", "history"], "one table for both"
    mean, std = dm.dense_stats["price"]
    assert (mean, std) == pytest.approx((14.5, np.std(np.arange(30.0))))
    val = dm.split("val")[torch.arange(10)]
    assert val.dense_features[:, 0].tolist() == pytest.approx(((np.arange(30, 40) - mean) / std).tolist())
    assert (tmp_path / "state" / "vocab_item.txt").read_text().split() == vocab

    restored = TabularDataModule(
        schema=SCHEMA, files=[str(path)], split={"timestamp": {"column": "day", "val_from": 30}}
    )
    restored.load_state_dict(json.loads(json.dumps(dm.state_dict())))
    restored.setup("fit")
    _same_batches(restored.split("val"), dm.split("val"))


def test_hash_ids_are_stable_across_processes_and_vocab_maps_unknown_values_to_row_0() -> None:
    code = (
        "import numpy as np; from lightning_rec.data.schema import hash_ids; "
        "print(hash_ids(np.array(['a', 'bb', 'é']), 1000).tolist(), hash_ids(np.array([1, 2, 3**30]), 1000).tolist())"
    )
    here = f"{hash_ids(np.array(['a', 'bb', 'é']), 1000).tolist()} {hash_ids(np.array([1, 2, 3**30]), 1000).tolist()}\n"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # another process, another string hash seed
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert there == here, "the string hash seed differs per process; the ids must not"
    assert len(set(hash_ids(np.arange(10_000), 2**40).tolist())) == 10_000
    assert Vocabulary(["x", "y"]).rows(np.array(["y", "z", "x"])).tolist() == [2, 0, 1]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.pop("price"), r"clicks.parquet: no column 'price'"),
        (lambda r: r.update(price=[f"p{i}" for i in range(40)]), r"column 'price' is string, a number was expected"),
        (lambda r: r["user"].__setitem__(13, None), r"row group 1, row 3: column 'user': null id"),
        (lambda r: r["price"].__setitem__(25, float("nan")), r"row group 2, row 5: column 'price': null, NaN or inf"),
        (lambda r: r.update(history=[f"i{i}" for i in range(40)]), r"column 'history' is string, a list was declared"),
    ],
)
def test_bad_parquet_is_refused_before_training_naming_file_place_column_value(
    change: Any, message: str, tmp_path: Path
) -> None:
    rows = _rows()
    change(rows)
    path = _clicks(tmp_path, rows, row_group_size=10)
    dm = TabularDataModule(schema=SCHEMA, files=[str(path)], split={"random": {"val": 0.25, "seed": 0}})
    with pytest.raises(DataError, match=message):
        dm.setup("fit")


def test_bad_csv_rows_name_their_line_and_drop_counts_them(tmp_path: Path) -> None:
    schema = {
        "labels": [{"column": "click"}],
        "dense": [{"column": "price", "transform": "log1p"}],
        "sparse": [{"column": "tags", "ids": "hash", "num_embeddings": 100, "list": True, "weights": "w"}],
    }
    lines = ["click,price,tags,w"] + [f"{i % 2},{i},a|b,0.5|2.0" for i in range(8)]
    lines[5] = "1,3,a|b|c,1.0|2.0"  # file line 6: three ids, two weights
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    kw: dict[str, Any] = dict(
        schema=schema, files=[str(tmp_path / "t.csv")], split={"random": {"val": 0.25, "seed": 0}}
    )
    with pytest.raises(DataError, match=r"t.csv, line 6: column 'w': weight list length differs from 'tags''s"):
        TabularDataModule(**kw).setup("fit")
    lines[7] = "0,inf,a,1.0"  # file line 8: inf
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"t.csv, line 8: column 'price': null, NaN or inf \(value inf\)"):
        TabularDataModule(**kw).setup("fit")
    dm = TabularDataModule(**kw, bad_rows="drop")
    dm.setup("fit")
    assert dm.dropped_rows == 2 and len(dm.split("train")) + len(dm.split("val")) == 6
    kjt = dm.split("train")[torch.arange(2)].sparse_features
    assert kjt.lengths().tolist() == [2, 2] and kjt.weights().tolist() == [0.5, 2.0, 0.5, 2.0], "a weighted feature"
    assert kjt.values().tolist() == hash_ids(np.array(["a", "b", "a", "b"]), 100).tolist()
