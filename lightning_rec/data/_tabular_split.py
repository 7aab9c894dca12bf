"""The split rules of :class:`~lightning_rec.data.tabular.TabularDataModule` (``{random: ...}``,
``{timestamp: ...}``): the settings checked when the rule is built, and every rule checked against the rows when it
splits them: a split it would leave empty is refused, naming the setting and the column's first and last value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timezone, tzinfo
from typing import Any

import numpy as np

from lightning_rec._choices import did_you_mean
from lightning_rec.data.movielens import _holdout_split

__all__ = ["SplitRule", "fill_spec", "known", "split_rows"]

_ISO = "'2026-11-12' or '2026-11-12T08:00:00'"


@dataclass
class SplitRule:
    """How one set of files is split: ``random`` (``{val, test, seed}``) or ``timestamp`` (``{column, val_from,
    test_from}``: rows at or after ``val_from`` validate, at or after ``test_from`` test; numbers in the column's
    unit, or ISO dates or date-times for a timestamp or date column).

    Example::

        >>> SplitRule(timestamp={"column": "ts", "val_from": "2026-11-12"}).timestamp["val_from"]
        '2026-11-12'
        >>> SplitRule(random={"val": 0.1, "tset": 0.1})
        Traceback (most recent call last):
        ...
        ValueError: TabularDataModule: split.random: unknown setting(s) ['tset'] (it takes val, test, seed); did you mean 'test'?
    """

    random: dict[str, float] | None = None
    timestamp: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.random is None) == (self.timestamp is None):
            raise ValueError("TabularDataModule: split takes one rule: {random: {...}} or {timestamp: {...}}.")
        if self.random is not None:
            r = dict(self.random)
            known("split.random", r, ("val", "test", "seed"))
            for key, default in (("val", 0.1), ("test", 0.0)):
                x = r.get(key, default)
                if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < 1:
                    raise ValueError(
                        f"TabularDataModule: split.random.{key} is {x!r}: a fraction of the rows, 0 <= {key} < 1, "
                        "was expected."
                    )
            if r.get("val", 0.1) + r.get("test", 0.0) >= 1:
                raise ValueError(
                    f"TabularDataModule: split.random: val {r.get('val', 0.1)} + test {r.get('test', 0.0)} leave no "
                    "training rows; their sum must be below 1."
                )
        if self.timestamp is not None:
            t = dict(self.timestamp)
            known("split.timestamp", t, ("column", "val_from", "test_from"))
            for key in ("column", "val_from"):
                if t.get(key) is None:
                    raise ValueError(f"TabularDataModule: split.timestamp needs `{key}` (it has {sorted(t)}).")
            for key in ("val_from", "test_from"):
                value = t.get(key)
                if value is not None and _as_number(value) is None and _as_time(value) is None:
                    raise ValueError(
                        f"TabularDataModule: split.timestamp.{key} is {value!r}: a number in the column's unit, or "
                        f"for a timestamp or date column an ISO date or date-time ({_ISO}), was expected."
                    )


def known(where: str, given: Mapping[str, Any], allowed: Sequence[str]) -> None:
    """Refuse settings other than ``allowed``, naming them and the allowed ones."""
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        near = did_you_mean(unknown[0], allowed) if len(unknown) == 1 else ""
        raise ValueError(
            f"TabularDataModule: {where}: unknown setting(s) {unknown} (it takes {', '.join(allowed)}){near or '.'}"
        )


def fill_spec(fill: Any, dense: Sequence[str]) -> dict[str, float | str]:
    """``fill`` (a number, ``"mean"``, or either per dense column) as ``{dense column: number or "mean"}``.

    Example::

        >>> fill_spec({"price": 0}, ["price", "age"]), fill_spec("mean", ["price", "age"])
        ({'price': 0.0}, {'price': 'mean', 'age': 'mean'})
    """
    if fill is None:
        return {}
    if isinstance(fill, Mapping):
        unknown = [c for c in fill if c not in dense]
        if unknown:
            raise ValueError(
                f"TabularDataModule: fill names {unknown}, which {'is' if len(unknown) == 1 else 'are'} no dense "
                f"column (the dense columns: {list(dense)})."
            )
        spec = dict(fill)
    else:
        spec = dict.fromkeys(dense, fill)
    for column, value in spec.items():
        if not (value == "mean" or not isinstance(value, str) and _as_number(value) is not None):
            raise ValueError(
                f"TabularDataModule: fill for dense column {column!r} is {value!r}: a number, or 'mean' (the training "
                f"split's mean), was expected{(did_you_mean(value, ['mean']) if isinstance(value, str) else '') or '.'}"
            )
    return {c: v if v == "mean" else float(v) for c, v in spec.items()}


def _as_number(value: Any) -> float | None:
    """A split boundary as a number in the column's unit (``None``: not a finite number)."""
    if isinstance(value, (bool, date, datetime)):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _as_time(value: Any) -> datetime | None:
    """A split boundary as a date-time (an ISO string, a ``date`` or a ``datetime``; ``None``: none of these)."""
    if isinstance(value, datetime):
        return value
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.strip())
        except ValueError:
            return None
    return None


def _said(value: Any) -> str:
    """A boundary as the user wrote it."""
    return repr(value.isoformat()) if isinstance(value, (date, datetime)) else repr(value)


def _zone(name: str) -> tzinfo:
    """A column's time zone: an IANA name, or an offset such as ``+01:00``."""
    from zoneinfo import ZoneInfo

    try:
        return ZoneInfo(name)
    except (KeyError, ValueError):
        return datetime.strptime(name.replace(":", ""), "%z").tzinfo or timezone.utc


def _show(x: Any, tz: str | None) -> str:
    """A value of the split column, for messages."""
    if isinstance(x, np.datetime64):
        return f"{x}{' UTC' if tz else ''}"
    x = float(x)
    return str(int(x)) if x.is_integer() else repr(x)


def _random_split(n: int, val: float, test: float, seed: int) -> np.ndarray:
    """0 train, 1 val, 2 test per row: the two-stage seeded holdout of MovieLensDataModule (same rows)."""
    split = np.zeros(n, dtype=np.int8)
    rest, held_test = _holdout_split(n, test, seed + 1)
    train, held_val = _holdout_split(len(rest), val / (1.0 - test), seed)
    split[held_test.numpy()] = 2
    split[rest[held_val].numpy()] = 1
    return split


def split_rows(rule: SplitRule, n: int, stamps: np.ndarray | None, tz: str | None = None) -> np.ndarray:
    """0 train, 1 val, 2 test for each of ``n`` rows (``stamps``: the timestamp rule's column, numbers or
    ``datetime64``, UTC where ``tz`` names the column's time zone).

    Raises:
        ValueError: a split the rule asks for would be empty, or ``test_from`` comes before ``val_from``: naming
            the setting and the column's first and last value.

    Example::

        >>> split_rows(SplitRule(timestamp={"column": "day", "val_from": 3}), 5, np.arange(5.0)).tolist()
        [0, 0, 0, 1, 1]
        >>> split_rows(SplitRule(timestamp={"column": "day", "val_from": 9}), 5, np.arange(5.0))
        Traceback (most recent call last):
        ...
        ValueError: TabularDataModule: split.timestamp.val_from 9 is after the last row: column 'day' runs from 0 to 4 (5 rows), so the validation split would have no rows. HINT: a val_from after the first row and at or before the last.
    """
    if rule.random is not None:
        r = dict(rule.random)
        fractions = {"train": 1.0, "val": float(r.get("val", 0.1)), "test": float(r.get("test", 0.0))}
        which = _random_split(n, fractions["val"], fractions["test"], int(r.get("seed", 0)))
        for i, (key, fraction) in enumerate(fractions.items()):
            if fraction > 0 and not (which == i).any():
                setting = "the rest" if key == "train" else f"split.random.{key} {fraction:g}"
                raise ValueError(
                    f"TabularDataModule: {setting} of {n} rows is no row: the {key} split would be empty. HINT: a "
                    "larger fraction, or more rows."
                )
        return which
    assert stamps is not None and rule.timestamp is not None
    t = dict(rule.timestamp)
    span = f"column {t['column']!r} runs from {_show(stamps.min(), tz)} to {_show(stamps.max(), tz)} ({n} rows)"
    val: Any = _boundary(t, "val_from", stamps, span, tz)
    test: Any = _boundary(t, "test_from", stamps, span, tz) if t.get("test_from") is not None else None
    said = {key: f"split.timestamp.{key} {_said(t.get(key))}" for key in ("val_from", "test_from")}
    if test is not None and test < val:
        raise ValueError(
            f"TabularDataModule: {said['test_from']} is before {said['val_from']}; {span}. Rows at or after val_from "
            "validate and rows at or after test_from test, so test_from must not come first. HINT: swap them."
        )
    which = np.zeros(n, dtype=np.int8)
    which[stamps >= val] = 1
    if test is not None:
        which[stamps >= test] = 2
    if not (which == 0).any():
        raise ValueError(
            f"TabularDataModule: {said['val_from']} is at or before the first row: {span}, so the training split "
            "would have no rows. HINT: a val_from after the first row."
        )
    if not (which == 1).any():
        where = "is after the last row" if not (stamps >= val).any() else "leaves no row before test_from"
        raise ValueError(
            f"TabularDataModule: {said['val_from']} {where}: {span}, so the validation split would have no rows. "
            "HINT: a val_from after the first row and at or before the last."
        )
    if test is not None and not (which == 2).any():
        raise ValueError(
            f"TabularDataModule: {said['test_from']} is after the last row: {span}, so the test split would have no "
            "rows. HINT: a test_from at or before the last row, or none (the validation split is then tested)."
        )
    return which


def _boundary(t: dict[str, Any], key: str, stamps: np.ndarray, span: str, tz: str | None) -> Any:
    """``val_from``/``test_from`` in the column's terms: a number, or a ``datetime64`` (UTC for a zoned column;
    a boundary without a zone is in the column's)."""
    value = t[key]
    if stamps.dtype.kind != "M":
        number = _as_number(value)
        if number is None:
            raise ValueError(
                f"TabularDataModule: split.timestamp.{key} is {_said(value)}, but {span} and holds numbers: give {key} "
                "as a number in the column's own unit, or store the column as an Arrow timestamp or date (CSV: ISO "
                "dates)."
            )
        return number
    when = _as_time(value)
    if when is None:
        raise ValueError(
            f"TabularDataModule: split.timestamp.{key} is {_said(value)}, but {span} and holds dates/times: give {key} "
            f"as an ISO date or date-time, e.g. {_ISO}."
        )
    if when.tzinfo is None and tz:
        when = when.replace(tzinfo=_zone(tz))
    if when.tzinfo is not None:
        when = when.astimezone(timezone.utc).replace(tzinfo=None)
    return np.datetime64(when, "us")
