"""A new user's own click log (issue 36, "Own data"), as Parquet and as CSV: string user ids, int item ids, a
variable-length category list, a price with some NaN and nulls, an Arrow timestamp and date, a click label.

Arrow timestamp/date columns split by ISO dates; every split rule is checked by ``check()`` (what the CLI runs in
the main process, before any rank starts) naming the column's first and last value; missing prices are filled (a
constant or the training mean) or dropped, counted and logged per split; CSV null tokens are declared, not guessed;
every data error names file, row group or line, column and value, empty and header-only files included.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from lightning_rec.data import DataError, TabularDataModule

N = 300
START = dt.datetime(2026, 11, 1)  # row i at START + i hours: the last row at 2026-11-13T11:00
VAL, TEST = 216, 264  # the first row of 2026-11-10 and of 2026-11-12
SPAN = "column 'ts' runs from 2026-11-01T00:00:00.000 to 2026-11-13T11:00:00.000 (300 rows)"
MISSING = [i for i in range(N) if i % 10 == 3 or i % 50 == 7]  # NaN (i % 10 == 3) or null (i % 50 == 7)

SCHEMA = {
    "labels": [{"column": "clicked"}],
    "dense": [{"column": "price"}],
    "sparse": [
        {"column": "user_id", "ids": "hash", "num_embeddings": 100},
        {"column": "item_id", "ids": "vocab"},
        {"column": "categories", "ids": "hash", "num_embeddings": 50, "list": True},
    ],
}
BY_DATE = {"timestamp": {"column": "ts", "val_from": "2026-11-10", "test_from": "2026-11-12"}}


def _price(i: int) -> float | None:
    if i % 50 == 7:
        return None
    if i % 10 == 3:
        return float("nan")
    return (i % 40) * 0.25 + (100.0 if i >= VAL else 0.0)  # val/test prices far off: a mean of all rows shows


def _log(tz: str | None = None) -> pa.Table:
    stamps = [START + dt.timedelta(hours=i) for i in range(N)]
    return pa.table(
        {
            "user_id": pa.array([f"u{i % 17}" for i in range(N)]),
            "item_id": pa.array([i % 23 for i in range(N)], pa.int64()),
            "categories": pa.array([[f"c{(i + k) % 5}" for k in range(i % 4)] for i in range(N)]),
            "price": pa.array([_price(i) for i in range(N)], pa.float64()),
            "ts": pa.array(stamps, pa.timestamp("ms", tz=tz)),
            "day": pa.array([s.date() for s in stamps], pa.date32()),
            "clicked": pa.array([float(i % 3 == 0) for i in range(N)]),
        }
    )


def _parquet(tmp: Path, table: pa.Table | None = None, name: str = "clicks.parquet") -> str:
    pq.write_table(_log() if table is None else table, tmp / name, row_group_size=100)
    return str(tmp / name)


def _csv_lines() -> list[str]:
    """The log as CSV: NaN prices written `n/a`, null ones empty; line i + 2 holds row i."""
    lines = ["user_id,item_id,categories,price,ts,clicked"]
    for i in range(N):
        p = _price(i)
        price = "" if p is None else "n/a" if np.isnan(p) else repr(p)
        cats = "|".join(f"c{(i + k) % 5}" for k in range(i % 4))
        ts = (START + dt.timedelta(hours=i)).isoformat(sep=" ")
        lines.append(f"u{i % 17},{i % 23},{cats},{price},{ts},{float(i % 3 == 0)}")
    return lines


def _csv(tmp: Path, lines: list[str], name: str = "clicks.csv") -> str:
    (tmp / name).write_text("\n".join(lines) + "\n")
    return str(tmp / name)


def _dm(files: list[str], split: Any = BY_DATE, fill: Any = 0.0, **kw: Any) -> TabularDataModule:
    return TabularDataModule(schema=SCHEMA, files=files, split=split, batch_size=64, fill=fill, **kw)


def _sizes(dm: TabularDataModule) -> tuple[int, ...]:
    dm.setup("fit")
    return tuple(len(dm.split(s)) for s in ("train", "val", "test"))


def _prices(dm: TabularDataModule, split: str) -> list[float]:
    data = dm.split(split)
    return data[torch.arange(len(data))].dense_features[:, 0].tolist()


# ---- timestamps and dates ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "column, val_from, test_from",
    [
        ("ts", "2026-11-10", "2026-11-12T00:00:00"),  # timestamp[ms], ISO strings
        ("day", dt.date(2026, 11, 10), dt.date(2026, 11, 12)),  # date32; YAML's unquoted 2026-11-10 is a date
        ("ts", dt.datetime(2026, 11, 10), "2026-11-12T01:00:00+01:00"),  # a zoned boundary: 00:00 UTC
    ],
)
def test_arrow_timestamp_and_date_columns_split_by_iso_dates(column: str, val_from: Any, test_from: Any, tmp_path):
    split = {"timestamp": {"column": column, "val_from": val_from, "test_from": test_from}}
    assert yaml.safe_load("val_from: 2026-11-10")["val_from"] == dt.date(2026, 11, 10)
    assert _sizes(_dm([_parquet(tmp_path)], split)) == (VAL, TEST - VAL, N - TEST)


def test_a_naive_iso_date_is_in_the_column_s_time_zone(tmp_path: Path) -> None:
    """Berlin is UTC+1 in November: "2026-11-10" there is 2026-11-09T23:00 UTC, one row earlier."""
    path = _parquet(tmp_path, _log(tz="Europe/Berlin"))
    assert _sizes(_dm([path], {"timestamp": {"column": "ts", "val_from": "2026-11-10"}}))[:2] == (VAL - 1, N - VAL + 1)
    with pytest.raises(ValueError) as err:
        _dm([path], {"timestamp": {"column": "ts", "val_from": "2026-12-01"}}).check()
    assert "runs from 2026-11-01T00:00:00.000 UTC to 2026-11-13T11:00:00.000 UTC (300 rows)" in str(err.value)


def test_a_date_for_a_number_column_or_a_number_for_a_date_column_names_the_setting(tmp_path: Path) -> None:
    epoch = int(START.replace(tzinfo=dt.timezone.utc).timestamp())
    seconds = _log().set_column(4, "ts", pa.array([epoch + 3600 * i for i in range(N)], pa.int64()))
    split = {"timestamp": {"column": "ts", "val_from": "2026-11-12"}}
    with pytest.raises(ValueError) as err:
        _dm([_parquet(tmp_path, seconds, "seconds.parquet")], split).check()
    assert str(err.value) == (
        f"TabularDataModule: split.timestamp.val_from is '2026-11-12', but column 'ts' runs from {epoch} to "
        f"{epoch + 3600 * (N - 1)} (300 rows) and holds numbers: give val_from as a number in the column's own unit, "
        "or store the column as an Arrow timestamp or date (CSV: ISO dates)."
    )
    numeric = {"timestamp": {"column": "ts", "val_from": epoch + 3600 * VAL}}
    assert _sizes(_dm([str(tmp_path / "seconds.parquet")], numeric))[:2] == (VAL, N - VAL), "a number in its unit"
    with pytest.raises(ValueError) as err:
        _dm([_parquet(tmp_path)], {"timestamp": {"column": "ts", "val_from": 1762905600}}).check()
    assert str(err.value) == (
        f"TabularDataModule: split.timestamp.val_from is 1762905600, but {SPAN} and holds dates/times: give val_from "
        "as an ISO date or date-time, e.g. '2026-11-12' or '2026-11-12T08:00:00'."
    )
    with pytest.raises(ValueError, match=r"^TabularDataModule: split.timestamp.val_from is '2026-13-45': a number in"):
        _dm([_parquet(tmp_path)], {"timestamp": {"column": "ts", "val_from": "2026-13-45"}})  # refused when built


def test_a_time_column_and_a_number_column_in_two_files_are_refused_naming_both(tmp_path: Path) -> None:
    seconds = _log().set_column(4, "ts", pa.array(range(N), pa.int64()))
    files = [_parquet(tmp_path), _parquet(tmp_path, seconds, "seconds.parquet")]
    with pytest.raises(DataError) as err:
        _dm(files).check()
    assert str(err.value) == (
        f"{files[1]}: column 'ts' is int64, but in {files[0]} it is timestamp[ms]: the split rule's column must hold "
        "numbers in every file, or dates/times in every file."
    )


# ---- every split rule, checked before any rank starts, with the column's range -------------------------------------
@pytest.mark.parametrize(
    "rule, message",
    [
        (
            {"val_from": "2026-10-01"},
            f"split.timestamp.val_from '2026-10-01' is at or before the first row: {SPAN}, so the training split "
            "would have no rows. HINT: a val_from after the first row.",
        ),
        (
            {"val_from": "2026-12-01"},
            f"split.timestamp.val_from '2026-12-01' is after the last row: {SPAN}, so the validation split would have "
            "no rows. HINT: a val_from after the first row and at or before the last.",
        ),
        (
            {"val_from": "2026-11-12", "test_from": "2026-11-10"},
            f"split.timestamp.test_from '2026-11-10' is before split.timestamp.val_from '2026-11-12'; {SPAN}. Rows at "
            "or after val_from validate and rows at or after test_from test, so test_from must not come first. HINT: "
            "swap them.",
        ),
        (
            {"val_from": "2026-11-12", "test_from": "2026-11-12"},
            f"split.timestamp.val_from '2026-11-12' leaves no row before test_from: {SPAN}, so the validation split "
            "would have no rows. HINT: a val_from after the first row and at or before the last.",
        ),
        (
            {"val_from": "2026-11-10", "test_from": "2026-12-01"},
            f"split.timestamp.test_from '2026-12-01' is after the last row: {SPAN}, so the test split would have no "
            "rows. HINT: a test_from at or before the last row, or none (the validation split is then tested).",
        ),
    ],
)
def test_a_split_rule_that_empties_a_split_is_refused_by_check_naming_the_column_s_range(
    rule: dict[str, Any], message: str, tmp_path: Path
) -> None:
    dm = _dm([_parquet(tmp_path)], {"timestamp": {"column": "ts", **rule}})
    with pytest.raises(ValueError) as err:
        dm.sparse_features  # noqa: B018 - what the CLI reads in the main process, before the strategy launches
    assert str(err.value) == f"TabularDataModule: {message}"


def test_the_cli_refuses_a_split_rule_in_one_line_before_fit_starts_any_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lightning.pytorch as pl

    from lightning_rec._cli import run

    def fit(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Trainer.fit ran: the split rule was not checked before the ranks started")

    monkeypatch.setattr(pl.Trainer, "fit", fit)
    # Nothing to learn (hash ids, a constant fill): only check() reads the files before fit.
    schema = {**SCHEMA, "sparse": [{**c, "ids": "hash", "num_embeddings": 100} for c in SCHEMA["sparse"]]}
    init = {"schema": schema, "files": [_parquet(tmp_path)], "fill": {"price": 0}, "csv_null_values": ["", "n/a"]}
    config = {
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "recshard", "logger": False},
        "model": {"class_path": "lightning_rec.models.DLRMModule"},
    }
    data = {"data": {"class_path": "lightning_rec.data.TabularDataModule", "init_args": init}}
    text = (
        yaml.safe_dump(config) + yaml.safe_dump(data) + "    split: {timestamp: {column: ts, val_from: 2026-12-01}}\n"
    )
    assert yaml.safe_load(text)["data"]["init_args"]["split"]["timestamp"]["val_from"] == dt.date(2026, 12, 1)
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(SystemExit) as exit_:
        run(["fit", "--config", str(tmp_path / "c.yaml")])
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()  # the program's name is pytest's here
    assert line.split(" fit: error: ", 1)[1] == (
        f"TabularDataModule: split.timestamp.val_from '2026-12-01' is after the last row: "
        f"{SPAN}, so the validation split would have no rows. HINT: a val_from after the first row and at or before "
        "the last."
    )


def test_a_random_rule_that_empties_a_split_or_misspells_a_setting_is_refused(tmp_path: Path) -> None:
    path = _parquet(tmp_path)
    with pytest.raises(ValueError) as err:
        _dm([path], {"random": {"val": 0.001, "seed": 0}}).check()
    assert str(err.value) == (
        "TabularDataModule: split.random.val 0.001 of 300 rows is no row: the val split would be empty. HINT: a "
        "larger fraction, or more rows."
    )
    with pytest.raises(ValueError) as err:
        _dm([path], {"random": {"val": 0.1, "tset": 0.1}})
    assert str(err.value) == (
        "TabularDataModule: split.random: unknown setting(s) ['tset'] (it takes val, test, seed); did you mean 'test'?"
    )
    with pytest.raises(ValueError) as err:
        _dm([path], {"random": {"val": 0.6, "test": 0.4}})
    assert str(err.value) == (
        "TabularDataModule: split.random: val 0.6 + test 0.4 leave no training rows; their sum must be below 1."
    )


# ---- missing dense values: fill (a constant, the training mean) or drop, counted and logged per split ---------------
def _log_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("TabularDataModule:")]


def test_fill_mean_is_the_training_split_s_mean_kept_in_the_state_and_counted_per_split(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    present = [_price(i) for i in range(VAL) if i not in MISSING]
    mean = float(np.sum(present) / len(present))  # the training rows only: val/test prices are 100 higher
    assert mean != float(np.nanmean([_price(i) if _price(i) is not None else np.nan for i in range(N)]))
    dm = _dm([_parquet(tmp_path)], fill="mean", state_dir=str(tmp_path / "state"))
    with caplog.at_level(logging.INFO):
        dm.check()
    assert dm.fill_means == {"price": mean} and dm.state_dict()["fill_means"] == {"price": mean}
    assert json.loads((tmp_path / "state" / "fill_means.json").read_text()) == {"price": mean}
    filled = {"train": 27, "val": 6, "test": 3}  # rows i % 10 == 3 or i % 50 == 7 in each split
    assert {s: dm.row_counts[s]["filled"]["price"] for s in filled} == filled and sum(filled.values()) == len(MISSING)
    assert _log_lines(caplog) == [
        "TabularDataModule: files: 300 rows read, 0 dropped (bad_rows: error).",
        f"TabularDataModule: train: 216 rows; 27 missing 'price' filled with {mean:g} (the training split's mean).",
        f"TabularDataModule: val: 48 rows; 6 missing 'price' filled with {mean:g} (the training split's mean).",
        f"TabularDataModule: test: 36 rows; 3 missing 'price' filled with {mean:g} (the training split's mean).",
    ]
    dm.setup("fit")
    first = {"train": 0, "val": VAL, "test": TEST}
    for split, start in first.items():
        want = [mean if start + j in MISSING else _price(start + j) for j in range(len(dm.split(split)))]
        assert _prices(dm, split) == np.float32(want).tolist(), split

    other = _log().set_column(3, "price", pa.array([None if i in MISSING else 7.0 for i in range(N)], pa.float64()))
    restored = _dm([_parquet(tmp_path, other, "other.parquet")], fill="mean")
    restored.load_state_dict(json.loads(json.dumps(dm.state_dict())))
    restored.setup("fit")
    assert restored.fill_means == {"price": mean}, "a checkpoint's mean, not one learned again"
    assert _prices(restored, "val")[223 - VAL] == np.float32(mean)


def test_fill_a_constant_per_column_and_drop_counts_what_it_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _parquet(tmp_path)
    dm = _dm([path], fill={"price": -1})
    assert _sizes(dm) == (VAL, TEST - VAL, N - TEST) and dm.dropped_rows == 0
    assert [i for i, p in enumerate(_prices(dm, "train")) if p == -1.0] == [i for i in MISSING if i < VAL]
    dropping = _dm([path], fill=None, bad_rows="drop")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert _sizes(dropping) == (VAL - 27, TEST - VAL - 6, N - TEST - 3)
    assert dropping.dropped_rows == len(MISSING) == 36
    assert _log_lines(caplog) == [
        "TabularDataModule: files: 300 rows read, 36 dropped (bad_rows: drop).",
        "TabularDataModule: train: 189 rows.",
        "TabularDataModule: val: 42 rows.",
        "TabularDataModule: test: 33 rows.",
    ]
    with pytest.raises(ValueError) as err:
        _dm([path], fill={"prize": 0.0})
    assert (
        str(err.value)
        == "TabularDataModule: fill names ['prize'], which is no dense column (the dense columns: ['price'])."
    )
    with pytest.raises(ValueError, match=r"fill for dense column 'price' is 'median': a number, or 'mean'"):
        _dm([path], fill="median")


def test_a_missing_price_without_fill_names_row_group_row_and_the_ways_out(tmp_path: Path) -> None:
    path = _parquet(tmp_path)
    with pytest.raises(DataError) as err:
        _dm([path], fill=None).check()
    assert str(err.value) == (
        f"{path}, row group 0, row 3: column 'price': null, NaN or inf (value nan; 12 such rows in this part). HINT: "
        "fix the data, set `fill: {price: 0.0}` (or `mean`, the training split's mean) to fill it, or set "
        "`bad_rows: drop` to drop such rows (they are counted)."
    )


def test_streamed_files_fill_missing_values_and_count_the_training_pass(tmp_path: Path) -> None:
    path = _parquet(tmp_path)
    dm = TabularDataModule(schema=SCHEMA, train=[path], val=[path], stream=True, fill="mean", batch_size=N)
    dm.setup("fit")
    present = [_price(i) for i in range(N) if i not in MISSING]
    assert dm.fill_means == {"price": float(np.sum(present) / len(present))}
    assert dm.row_counts["train"] == {"read": N, "dropped": 0, "rows": N, "filled": {"price": len(MISSING)}}
    [batch] = list(dm.val_dataloader())
    assert (
        batch.dense_features[:, 0].tolist()
        == np.float32([dm.fill_means["price"] if i in MISSING else _price(i) for i in range(N)]).tolist()
    )


# ---- CSV: null tokens declared, not guessed; errors name line, column and value ------------------------------------
def test_csv_null_tokens_are_declared_not_guessed(tmp_path: Path) -> None:
    path = _csv(tmp_path, _csv_lines())
    with pytest.raises(DataError) as err:
        _dm([path], fill="mean").check()
    assert str(err.value) == (
        f"{path}, line 5: column 'price': 'n/a' is not a number (dense). HINT: if it marks a missing value, declare "
        'it a null token: `csv_null_values: ["", "n/a"]`.'
    )
    declared = _dm([path], fill="mean", csv_null_values=["", "n/a"])
    parquet = _dm([_parquet(tmp_path)], fill="mean")
    assert _sizes(declared) == _sizes(parquet) and declared.fill_means == parquet.fill_means
    assert declared.row_counts == parquet.row_counts
    for split in ("train", "val", "test"):
        a, b = declared.split(split), parquet.split(split)
        x, y = a[torch.arange(len(a))], b[torch.arange(len(b))]
        assert torch.equal(x.dense_features, y.dense_features) and torch.equal(x.labels, y.labels)
        assert torch.equal(x.sparse_features.values(), y.sparse_features.values())
        assert torch.equal(x.sparse_features.lengths(), y.sparse_features.lengths())
    with pytest.raises(DataError) as err:
        _dm([path], fill=None, csv_null_values=["", "n/a"]).check()
    assert str(err.value).startswith(f"{path}, line 5: column 'price': null, NaN or inf (value None; 36 such rows")


@pytest.mark.parametrize(
    "line, field, value, message",
    [
        (252, 3, "12.5.0", "line 252: column 'price': '12.5.0' is not a number (dense)."),
        (101, 5, "yes", "line 101: column 'clicked': 'yes' is not a number (label)."),
        (77, 4, "yesterday", "line 77: column 'ts': 'yesterday' is not a number, an ISO date or an ISO date and time"),
    ],
)
def test_a_bad_csv_value_names_its_line_column_and_value(
    line: int, field: int, value: str, message: str, tmp_path: Path
) -> None:
    lines = _csv_lines()
    fields = lines[line - 1].split(",")
    fields[field] = value
    lines[line - 1] = ",".join(fields)
    path = _csv(tmp_path, lines)
    with pytest.raises(DataError) as err:
        _dm([path], fill=0.0, csv_null_values=["", "n/a"]).check()
    assert str(err.value).startswith(f"{path}, {message}")


# ---- empty and header-only files -------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_empty_and_header_only_files_are_named(stream: bool, tmp_path: Path) -> None:
    (tmp_path / "empty.parquet").write_bytes(b"")
    header = _csv(tmp_path, _csv_lines()[:1], "header.csv")
    pq.write_table(_log().slice(0, 0), tmp_path / "no_rows.parquet")
    good = _parquet(tmp_path)
    cases = {
        str(tmp_path / "empty.parquet"): "the file is empty (0 bytes), a Parquet file was expected.",
        header: "no rows: line 1 is the header and no line follows it.",
        str(tmp_path / "no_rows.parquet"): "no rows.",
    }
    for path, message in cases.items():
        dm = TabularDataModule(schema=SCHEMA, train=[good, path], val=[good], stream=stream, fill=0.0)
        with pytest.raises(DataError) as err:
            dm.check()
        assert str(err.value) == f"{path}: {message}"
