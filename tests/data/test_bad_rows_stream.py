"""``bad_rows: drop`` streamed (``stream: true``) drops exactly the rows the in-memory DataModule drops: the same rows
trained and scored, the same counts, on one rank and across two, and a mid-epoch resume gives the rest exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_rec.data import TabularDataModule

N, B = 240, 16
# bad rows (what `bad_rows` covers in a column of the right type): a missing label, a missing price, an infinite or
# NaN price, a missing id
BAD = sorted({i for i in range(N) if i % 11 == 4 or i % 29 == 9 or i % 37 == 0 or 100 <= i < 150 or i % 41 == 5})
SCHEMA = {
    "labels": [{"column": "clicked"}],
    "dense": [{"column": "row"}, {"column": "price"}],
    "sparse": [
        {"column": "user_id", "ids": "hash", "num_embeddings": 100},
        {"column": "item_id", "ids": "vocab"},
    ],
}


def _bad(i: int) -> str:
    """What is wrong with row ``i`` ("" for a good row)."""
    if i % 37 == 0 or 100 <= i < 150:  # a whole Parquet row group (and CSV unit) of bad rows
        return "label"
    if i % 29 == 9:
        return "price"
    if i % 41 == 5:
        return "id"
    return "nan" if i % 11 == 4 else ""


def _csv(tmp: Path) -> str:
    lines = ["row,user_id,item_id,price,clicked"]
    for i in range(N):
        bad = _bad(i)
        label = "" if bad == "label" else f"{float(i % 3 == 0)}"
        price = "" if bad == "price" else "inf" if bad == "nan" and i % 2 else "nan" if bad == "nan" else f"{i / 10}"
        user = "" if bad == "id" else f"u{i % 13}"
        lines.append(f"{i},{user},{i % 19},{price},{label}")
    path = tmp / "clicks.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _parquet(tmp: Path) -> str:
    bad = [_bad(i) for i in range(N)]
    table = pa.table(
        {
            "row": pa.array(np.arange(N, dtype=np.float64)),
            "user_id": pa.array([None if b == "id" else f"u{i % 13}" for i, b in enumerate(bad)]),
            "item_id": pa.array([i % 19 for i in range(N)]),
            "price": pa.array([None if b == "price" else np.nan if b == "nan" else i / 10 for i, b in enumerate(bad)]),
            "clicked": pa.array([None if b == "label" else float(i % 3 == 0) for i, b in enumerate(bad)]),
        }
    )
    path = tmp / "clicks.parquet"
    pq.write_table(table, path, row_group_size=50)  # 5 row groups, every one with bad rows
    return str(path)


@pytest.fixture(scope="module", params=["csv", "parquet"])
def data(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp(request.param)
    return _csv(tmp) if request.param == "csv" else _parquet(tmp)


def _dm(path: str, stream: bool) -> TabularDataModule:
    # chunk_bytes: a CSV file cut into several units (~30 lines each), so bad rows fall in many units
    return TabularDataModule(
        schema=SCHEMA,
        train=[path],
        val=[path],
        batch_size=B,
        bad_rows="drop",
        stream=stream,
        window=2,
        chunk_bytes=700,
    )


def _rows(batches: list[Any]) -> list[tuple[int, float]]:
    """Each row's (row number, label), in the order the batches hold them."""
    return [(int(r), float(y)) for b in batches for r, y in zip(b.dense_features[:, 0], b.labels)]


def _good() -> list[int]:
    return [i for i in range(N) if i not in BAD]


def test_streamed_rows_are_the_in_memory_rows_with_the_same_counts(data: str) -> None:
    memory, streamed = _dm(data, False), _dm(data, True)
    memory.setup("fit")
    streamed.setup("fit")
    expected = [(i, float(i % 3 == 0)) for i in _good()]
    in_memory = list(memory.val_dataloader())
    assert _rows(in_memory) == expected
    val = list(streamed.val_dataloader())  # in file order: the same rows in the same batches
    assert _rows(val) == expected
    # as many batches (a stream cuts its rows into batches whose sizes differ by at most one, with or without drops)
    assert len(val) == len(in_memory)
    train = streamed.split("train")
    batches = list(iter(train))
    assert len(batches) == len(train) == -(-len(expected) // B)
    assert sorted(_rows(batches)) == expected  # every kept row once, no dropped row
    assert streamed.dropped_rows == memory.dropped_rows == 2 * len(BAD)  # train and val: the same file
    assert streamed.row_counts == memory.row_counts


def test_two_ranks_split_the_kept_rows_and_resume_mid_epoch_exactly(data: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ranks, state = [], None
    for rank in (0, 1):
        monkeypatch.setattr(TabularDataModule, "rank_and_world_size", property(lambda self, r=rank: (r, 2)))
        dm = _dm(data, True)
        if state is not None:  # as from a checkpoint: nothing left to learn, the kept rows found by their own pass
            dm.load_state_dict(state)
        dm.setup("fit")
        state = dm.state_dict()
        ranks.append(dm.split("train"))
        assert len(dm._units("train")) >= 5 and dm.row_counts["train"]["rows"] == len(_good())
    full = [list(iter(s)) for s in ranks]
    assert len(full[0]) == len(full[1]) == len(ranks[0])
    rows = _rows(full[0]) + _rows(full[1])
    assert sorted(rows) == [(i, float(i % 3 == 0)) for i in _good()]
    for stream, batches in zip(ranks, full):
        for start in (1, 3):  # in the middle of a window (window=2) and at its start
            stream.start_batch = start
            assert _rows(list(iter(stream))) == _rows(batches[start:])
        stream.start_batch = 0
