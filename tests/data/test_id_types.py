"""An id is an id, whatever its file's type (issue 44): ``"42"`` in a text column and ``42`` in an integer column map
to the same row under ``hash`` and ``vocab``, in CSV (a stray word in one file makes pyarrow read its column as text)
and in Parquet (``int64`` in one file, ``string`` in another); text in a ``raw`` id column is refused naming file,
line or row group, column and value."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from lightning_rec.data import DataError, TabularDataModule
from lightning_rec.data.schema import Vocabulary, hash_ids

N = 200
ITEMS = [(i * 37) % 61 - 5 for i in range(N)]  # negative ids too
STRAY = 17  # the row whose item id is a word in the text files


def _table(item: pa.Array) -> pa.Table:
    return pa.table({"clicked": pa.array([float(i % 2) for i in range(N)]), "item_id": item})


def _files(tmp: Path, fmt: str) -> tuple[str, str, str]:
    """The training file (integers), a validation file of integers, and the same validation rows as text with one
    stray word (CSV: as a user's export writes it, so pyarrow reads the column as text; Parquet: a string column)."""
    ints = _table(pa.array(ITEMS, pa.int64()))
    text = [str(v) if i != STRAY else "abc" for i, v in enumerate(ITEMS)]
    if fmt == "csv":
        pacsv.write_csv(ints, tmp / "train.csv")
        pacsv.write_csv(ints, tmp / "val_int.csv")
        pacsv.write_csv(_table(pa.array(text)), tmp / "val_text.csv")
        assert pacsv.read_csv(tmp / "val_text.csv").column("item_id").type == pa.string()
        return str(tmp / "train.csv"), str(tmp / "val_int.csv"), str(tmp / "val_text.csv")
    pq.write_table(ints, tmp / "train.parquet")
    pq.write_table(ints, tmp / "val_int.parquet")
    pq.write_table(_table(pa.array(text, pa.string())), tmp / "val_text.parquet")
    return str(tmp / "train.parquet"), str(tmp / "val_int.parquet"), str(tmp / "val_text.parquet")


def _val_rows(train: str, val: str, ids: str, stream: bool) -> np.ndarray:
    column = {"column": "item_id", "ids": ids} | ({"num_embeddings": 1000} if ids == "hash" else {})
    dm = TabularDataModule(
        schema={"labels": [{"column": "clicked"}], "sparse": [column]},
        train=[train],
        val=[val],
        stream=stream,
        batch_size=N,
    )
    dm.setup("fit")
    if not stream:
        return dm.split("val").sparse["item_id"].numpy()
    [batch] = list(dm.split("val"))
    return batch.sparse_features["item_id"].values().numpy()


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
@pytest.mark.parametrize("ids", ["hash", "vocab"])
@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_an_id_maps_to_one_row_whether_its_column_is_integers_or_text(
    fmt: str, ids: str, stream: bool, tmp_path: Path
) -> None:
    train, val_int, val_text = _files(tmp_path, fmt)
    rows_int = _val_rows(train, val_int, ids, stream)
    rows_text = _val_rows(train, val_text, ids, stream)
    same = np.arange(N) != STRAY
    assert np.array_equal(rows_text[same], rows_int[same])
    if ids == "vocab":  # the rows follow the training split's counts: each id has one row, unseen "abc" row 0
        for v in set(ITEMS):
            at = np.flatnonzero((np.array(ITEMS) == v) & same)
            assert len(set(rows_text[at].tolist())) == 1 and rows_text[at][0] != 0
        assert rows_text[STRAY] == 0  # "abc": out of vocabulary
    else:
        assert np.array_equal(rows_text[same], hash_ids(np.array(ITEMS), 1000)[same])  # computed without the module
        assert rows_text[STRAY] == hash_ids(np.array(["abc"]), 1000)[0]


def _fnv1a(text: str) -> int:
    """FNV-1a (64 bit) of a text's UTF-8 bytes, by the book."""
    z = 0xCBF29CE484222325
    for byte in text.encode():
        z = ((z ^ byte) * 0x100000001B3) % 2**64
    return z


def _splitmix(value: int) -> int:
    z = (value + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def test_integer_text_hashes_as_the_integer_and_other_text_by_its_bytes() -> None:
    """The hash against a by-the-book reference: integers (and their decimal text, leading zeros and the minus sign
    included, up to 2**64 - 1) through SplitMix64 of their 64-bit pattern; any other text, FNV-1a of its bytes, as
    before the change (a trained model's text ids keep their rows)."""
    n = 2**61 - 1
    integers = ["42", "-7", "007", "0", "-0", "9223372036854775807", "-9223372036854775808", "18446744073709551615"]
    texts = ["abc", "4.0", "+4", " 4", "0x4", "1e3", "", "é", "٤٢", "18446744073709551616", "-9223372036854775809"]
    got = hash_ids(np.array(integers + texts), n).tolist()
    expected = [_splitmix(int(t) % 2**64) % n for t in integers] + [_fnv1a(t) % n for t in texts]
    assert got == expected
    assert hash_ids(np.array([42, -7, 7]), n).tolist() == got[:3]


def test_vocab_treats_integer_text_as_the_integer() -> None:
    vocab = Vocabulary(["abc", "42", "007"])  # as a vocabulary file holds them
    assert vocab.rows(np.array([42, 7, 8])).tolist() == [2, 3, 0]
    assert vocab.rows(np.array(["42", "042", "7", "abc", "x"])).tolist() == [2, 2, 3, 1, 0]


# ---- ids: raw -----------------------------------------------------------------------------------------------------
def _raw(tmp: Path, fmt: str) -> tuple[str, str]:
    values = [str(i % 16) for i in range(N)]
    values[150] = "FR"
    table = _table(pa.array(values))
    if fmt == "csv":
        pacsv.write_csv(_table(pa.array(ITEMS, pa.int64())), tmp / "train.csv")
        pacsv.write_csv(table, tmp / "val.csv")
        return str(tmp / "train.csv"), str(tmp / "val.csv")
    pq.write_table(_table(pa.array(ITEMS, pa.int64())), tmp / "train.parquet")
    pq.write_table(table, tmp / "val.parquet", row_group_size=64)
    return str(tmp / "train.parquet"), str(tmp / "val.parquet")


@pytest.mark.parametrize("fmt, where", [("csv", "line 152"), ("parquet", "row group 2, row 22")])
def test_text_in_a_raw_id_column_names_file_place_column_and_value(fmt: str, where: str, tmp_path: Path) -> None:
    train, val = _raw(tmp_path, fmt)
    schema = {"labels": [{"column": "clicked"}], "sparse": [{"column": "item_id", "ids": "raw", "num_embeddings": 64}]}
    dm = TabularDataModule(schema=schema, train=[train], val=[val])
    with pytest.raises(DataError) as err:
        dm.check()  # what the CLI runs in the main process, before any rank starts
    assert str(err.value) == (
        f"{val}, {where}: column 'item_id': text in an integer id column (ids: raw reads each id as its row; for text "
        "ids declare ids: hash or vocab) (value 'FR'). HINT: fix the data, or set `bad_rows: drop` to drop such rows "
        "(they are counted)."
    )
    dropping = TabularDataModule(schema=schema, train=[train], val=[val], bad_rows="drop")
    dropping.setup("fit")
    expected = [i % 16 for i in range(N) if i != 150]  # the integers written as text are the rows
    assert dropping.split("val").sparse["item_id"].tolist() == expected and dropping.dropped_rows == 1
