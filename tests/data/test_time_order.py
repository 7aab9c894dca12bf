"""Time-ordered replay (issue 47, "Train on time"): TabularDataModule(period=...) gives the training rows in time order,
period after period, on every rank count, streamed and in memory; the periods checked against pandas' own calendar
arithmetic on the same column; bad settings refused in one line; a mid-period checkpoint resumes at the next batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from lightning_rec.data import TabularDataModule
from lightning_rec.errors import CheckpointError

SCHEMA = {
    "labels": [{"column": "click"}],
    "dense": [{"column": "rid"}],  # the row's place in the files, to see which rows came
    "sparse": [{"column": "user", "ids": "hash", "num_embeddings": 100}],
}
N = 211  # odd, and neither batches nor periods divide it


def _rows(seed: int = 3) -> pd.DataFrame:
    """211 events over 6 days, unsorted, with ties (seconds rounded to 15 minutes), days of unequal size."""
    rng = np.random.default_rng(seed)
    day = rng.choice(6, N, p=[0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    ts = 1_780_000_000 + day * 86_400 + rng.integers(0, 96, N) * 900  # 2026-05-28 onwards
    return pd.DataFrame(
        {"click": (rng.random(N) < 0.4).astype(float), "rid": np.arange(N, dtype=float), "user": rng.integers(0, 30, N)}
    ).assign(ts=ts)


def _files(tmp: Path, df: pd.DataFrame) -> list[str]:
    """The rows in a Parquet file of row groups of 23 and a CSV file (two kinds of unit)."""
    table = pa.Table.from_pandas(df, preserve_index=False)
    pq.write_table(table.slice(0, 130), tmp / "a.parquet", row_group_size=23)
    pacsv.write_csv(table.slice(130), tmp / "b.csv")
    return [str(tmp / "a.parquet"), str(tmp / "b.csv")]


def _loaders(dm: TabularDataModule, world: int, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Each rank's training loader, without a trainer (the rank taken from ``_rank``)."""
    # on the class itself: tests/data/test_stream.py sets its own there for the rest of the session
    monkeypatch.setattr(
        TabularDataModule, "rank_and_world_size", property(lambda self: (getattr(self, "_rank", 0), world))
    )
    loaders = []
    for rank in range(world):
        dm._rank = rank  # type: ignore[attr-defined]
        loaders.append(dm.dataloader("train"))
    return loaders


def _rids(batch: Any) -> list[int]:
    return [int(x) for x in batch.dense_features[:, 0].tolist()]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "in-memory"])
@pytest.mark.parametrize("world", [1, 2])
def test_batches_come_in_time_order_by_period(
    stream: bool, world: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    df = _rows()
    dm = TabularDataModule(
        schema=SCHEMA, train=_files(tmp_path, df), stream=stream, period="day", time_column="ts", batch_size=8, window=3
    )
    dm.setup("fit")
    day = pd.to_datetime(df.ts, unit="s", utc=True).dt.floor("D")
    sizes = day.value_counts().sort_index()
    per_rank = [[_rids(b) for b in loader] for loader in _loaders(dm, world, monkeypatch)]
    periods = dm.periods  # for this many ranks
    assert [p.rows for p in periods] == sizes.tolist() and len(set(sizes)) > 1, "periods of unequal size"
    assert [p.start for p in periods] == [d.isoformat() for d in sizes.index]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == sum(p.batches for p in periods)
    order = df.sort_values("ts", kind="stable").rid.astype(int).tolist()  # ties in file order
    rank_of_row = {}
    for rank, batches in enumerate(per_rank):
        rows = [r for b in batches for r in b]
        assert rows == [r for r in order if r in set(rows)], f"rank {rank}: time order, ties in file order"
        rank_of_row.update(dict.fromkeys(rows, rank))
    assert sorted(rank_of_row) == list(range(N)), "every row once"
    for step in range(len(per_rank[0])):  # every rank in the same period at every step, no batch across two
        days = {day[r] for rank in range(world) for r in per_rank[rank][step]}
        assert len(days) == 1, f"step {step}: rows of {sorted(days)}"
        p = next(p for p in periods if p.first_batch <= step < p.first_batch + p.batches)
        assert days == {pd.Timestamp(p.start)}, f"step {step} belongs to period {p.index}"
        assert dm.period_of(step) == p
    if world == 1:
        assert [r for b in per_rank[0] for r in b] == order


def test_hour_and_day_periods_start_at_the_zone_s_midnight(tmp_path: Path) -> None:
    """A zoned timestamp column across the spring DST change in Paris: days start at local midnight, hours at local
    hours (the 23-hour day included), as pandas floors them."""
    rng = np.random.default_rng(0)
    utc = pd.Timestamp("2026-03-28T20:00:00Z") + pd.to_timedelta(np.sort(rng.integers(0, 40 * 3600, 97)), unit="s")
    local = utc.tz_convert("Europe/Paris")
    df = pd.DataFrame(
        {"click": np.arange(97) % 2 * 1.0, "rid": np.arange(97.0), "user": np.arange(97) % 7, "ts": local}
    )
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), tmp_path / "z.parquet")
    for period, floor in (("day", local.normalize()), ("hour", local.floor("h"))):
        dm = TabularDataModule(schema=SCHEMA, train=str(tmp_path / "z.parquet"), period=period, time_column="ts")
        sizes = pd.Series(floor).value_counts().sort_index()
        assert [(p.start, p.rows) for p in dm.periods] == [(t.isoformat(), n) for t, n in sizes.items()], period
    assert {p.start[-6:] for p in dm.periods} == {"+01:00", "+02:00"}, "both sides of the change"
    found = TabularDataModule(schema=SCHEMA, train=str(tmp_path / "z.parquet"), period="hour")  # its one time column
    assert [p.as_dict() for p in found.periods] == [p.as_dict() for p in dm.periods]


def test_periods_of_rows_and_week_periods(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _files(tmp_path, _rows())
    dm = TabularDataModule(schema=SCHEMA, train=files, stream=True, period=50, time_column="ts", batch_size=8)
    dm.setup("fit")
    a, b = _loaders(dm, 2, monkeypatch)
    assert [p.rows for p in dm.periods] == [50, 50, 50, 50, 11]
    assert [p.batches for p in dm.periods] == [4, 4, 4, 4, 1] and len(list(a)) == len(list(b)) == 17
    week = TabularDataModule(schema=SCHEMA, train=files, stream=True, period="week", time_column="ts")
    assert [(p.start, p.rows) for p in week.periods] == [
        (d.isoformat(), n)
        for d, n in pd.to_datetime(_rows().ts, unit="s", utc=True)
        .dt.to_period("W-SUN")
        .dt.start_time.dt.tz_localize("UTC")
        .value_counts()
        .sort_index()
        .items()
    ], "weeks from Monday"


def test_dropped_rows_leave_the_time_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    df = _rows().astype({"rid": float})
    df.loc[[5, 77, 150], "rid"] = np.nan  # bad rows (a NaN dense value), in a row group and in the CSV
    dm = TabularDataModule(
        schema=SCHEMA, train=_files(tmp_path, df), stream=True, period="day", time_column="ts", bad_rows="drop"
    )
    dm.setup("fit")
    [loader] = _loaders(dm, 1, monkeypatch)
    kept = df.dropna().sort_values("ts", kind="stable").rid.astype(int).tolist()
    assert [r for b in loader for r in _rids(b)] == kept and sum(p.rows for p in dm.periods) == N - 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"period": "dya", "time_column": "ts"},
            "period 'dya' is not one of 'hour', 'day', 'week' or a number of rows (e.g. 10000); did you mean 'day'?",
        ),
        ({"period": "weekly", "time_column": "ts"}, "did you mean 'week'?"),
        ({"period": 0, "time_column": "ts"}, "period 0 is not one of"),
        ({"time_column": "ts"}, "time_column 'ts' is read only to order the rows by time: give a period too"),
    ],
)
def test_a_bad_period_setting_is_one_line_before_anything_is_read(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        TabularDataModule(schema=SCHEMA, train=["no/such/file.parquet"], **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_period_without_its_column_or_of_too_few_rows_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _files(tmp_path, _rows())
    with pytest.raises(
        ValueError,
        match=r"period 'day' orders the training rows by time, and .*a\.parquet has no one "
        r"timestamp column nor one named 'timestamp' \(its columns: click, rid, user, ts\): name it",
    ):
        TabularDataModule(schema=SCHEMA, train=files, period="day").check()
    millis = _rows().assign(ts=lambda d: d.ts * 1000)
    pq.write_table(pa.Table.from_pandas(millis, preserve_index=False), tmp_path / "ms.parquet")
    with pytest.raises(ValueError, match=r"column 'ts' holds numbers up to 1\.78\d+e\+12; .* seconds since 1970"):
        TabularDataModule(schema=SCHEMA, train=str(tmp_path / "ms.parquet"), period="day", time_column="ts").check()
    one = _rows().assign(ts=lambda d: np.where(d.rid == 0, 1_700_000_000, d.ts))  # a day with one row, 2 ranks
    pq.write_table(pa.Table.from_pandas(one, preserve_index=False), tmp_path / "one.parquet")
    dm = TabularDataModule(schema=SCHEMA, train=str(tmp_path / "one.parquet"), period="day", time_column="ts")
    with pytest.raises(ValueError, match=r"period 0 \(2023-11-14T00:00:00\+00:00 to .*\) has 1 row\(s\), fewer than"):
        _loaders(dm, 2, monkeypatch)


def test_a_mid_period_checkpoint_resumes_at_the_next_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dm = TabularDataModule(
        schema=SCHEMA, train=_files(tmp_path, _rows()), stream=True, period="day", time_column="ts", batch_size=8
    )
    dm.setup("fit")
    full = [[_rids(b) for b in loader] for loader in _loaders(dm, 2, monkeypatch)]
    served = next(p.first_batch + 1 for p in dm.periods if p.batches > 2)  # inside a period
    for rank, loader in enumerate(_loaders(dm, 2, monkeypatch)):
        loader.load_state_dict({"epoch": 0, "served": served, "world_size": 2, "batch_size": 8, "num_workers": 0})
        assert [_rids(b) for b in loader] == full[rank][served:]
    [other] = _loaders(dm, 1, monkeypatch)
    with pytest.raises(CheckpointError, match=r"middle of a time-ordered epoch \(period\).*this run has 1 process"):
        other.load_state_dict({"epoch": 0, "served": served, "world_size": 2, "batch_size": 8, "num_workers": 0})
