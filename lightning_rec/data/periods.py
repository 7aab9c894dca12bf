"""Time-ordered replay: a training split's rows in the order of their time column, cut into periods (an hour, a day,
a week, or a number of rows), as :class:`~lightning_rec.data.TabularDataModule` (``period:``) trains them.

The rows are ordered by time, ties in the order the files hold them (a stable sort). Each period's rows are then cut
as an epoch's are (:func:`~lightning_rec.data.base.rank_batches`' rule, per period): into ``world_size`` contiguous
shares, each into the same number of batches. So every rank is in the same period at every step, no batch holds
rows of two periods, and a period's batches come in time order on each rank.

Calendar periods (``hour``, ``day``, ``week``; weeks start on Monday) begin at the column's local midnight (or hour)
when it is an Arrow timestamp column with a time zone (daylight saving time included), at UTC's for a number column,
which is read as seconds since 1970 (Unix time), and at the wall clock's for a timestamp without a zone. Periods
without rows are skipped: period numbers count the periods that have rows.

Example::

    order = time_order([np.array([30.0, 10.0, 20.0])], None, 2)   # seconds; periods of 2 rows
    order.order.tolist(), order.bounds.tolist()                    # ([1, 2, 0], [0, 2, 3])
    [p.rows for p in order.periods(world_size=1, batch_size=1)]    # [2, 1]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

import numpy as np

from lightning_rec._choices import did_you_mean
from lightning_rec.data.elastic import cut

__all__ = ["CALENDAR", "Period", "TimeOrder", "check_period", "time_order"]

CALENDAR = ("hour", "day", "week")
# A number column is read as seconds since 1970: above this (the year 5138) it is more likely milliseconds.
_MAX_SECONDS = 1e11


def check_period(period: Any) -> str | int | None:
    """``period`` as ``"hour"``/``"day"``/``"week"`` or a number of rows (``None``: no time order).

    Raises:
        ValueError: anything else, in one line, with the nearest calendar period.

    Example::

        >>> check_period("day"), check_period(500), check_period("500")
        ('day', 500, 500)
        >>> check_period("dya")
        Traceback (most recent call last):
        ...
        ValueError: TabularDataModule: period 'dya' is not one of 'hour', 'day', 'week' or a number of rows (e.g. 10000); did you mean 'day'?
    """
    if period is None:
        return None
    if isinstance(period, str) and period.strip().isdigit():
        period = int(period.strip())
    if isinstance(period, int) and not isinstance(period, bool):
        if period >= 1:
            return period
    elif isinstance(period, str) and period in CALENDAR:
        return period
    near = did_you_mean(period, CALENDAR) if isinstance(period, str) else ""
    raise ValueError(
        f"TabularDataModule: period {period!r} is not one of 'hour', 'day', 'week' or a number of rows (e.g. 10000)"
        f"{near or '.'}"
    )


@dataclass(frozen=True)
class Period:
    """One period of a time-ordered training split (:attr:`TabularDataModule.periods
    <lightning_rec.data.TabularDataModule.periods>`).

    Attributes:
        index: the period's number (0-based; periods without rows are skipped).
        start, end: a calendar period's bounds, ``[start, end)``, as ISO date-times (with the column's offset for a
            zoned column, ``+00:00`` for a number column); for a period of rows, its first and last event time.
        first_event, last_event: the time of its first and last row, as the column holds it (an ISO date-time, or
            the number).
        rows: its rows, over all ranks.
        first_batch: the number, in its epoch, of its first batch (the same on every rank).
        batches: how many batches each rank runs of it.
    """

    index: int
    start: Any
    end: Any
    first_event: Any
    last_event: Any
    rows: int
    first_batch: int
    batches: int

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict."""
        return asdict(self)


@dataclass
class TimeOrder:
    """A split's rows in time order and where its periods begin.

    Attributes:
        order: the rows' positions (in the order the files hold them, units in turn) in time order, or ``None``
            where the files already hold them in time order.
        bounds: ``bounds[p]:bounds[p + 1]`` are period ``p``'s positions in time order (``P + 1`` entries).
        times: per period, ``(start, end, first_event, last_event)`` (see :class:`Period`).
        kept: per unit (its index in the split's units) whose bad rows ``bad_rows: drop`` drops, which of its rows
            are kept (positions count kept rows only).
    """

    order: np.ndarray | None
    bounds: np.ndarray
    times: list[tuple[Any, Any, Any, Any]]
    kept: dict[int, np.ndarray]

    @property
    def rows(self) -> int:
        """The rows in all periods."""
        return int(self.bounds[-1])

    def periods(self, world_size: int, batch_size: int) -> list[Period]:
        """The periods with their batches for ``world_size`` ranks of ``batch_size`` rows.

        Raises:
            ValueError: a period has fewer rows than there are ranks (every rank runs every period), named.
        """
        out, first = [], 0
        for p, (lo, hi) in enumerate(zip(self.bounds[:-1].tolist(), self.bounds[1:].tolist())):
            n = hi - lo
            if n < world_size:
                start, end = self.times[p][:2]
                raise ValueError(
                    f"TabularDataModule: period {p} ({start} to {end}) has {n} row(s), fewer than the {world_size} "
                    "ranks: every rank trains on every period. HINT: a longer period, or fewer processes."
                )
            batches = math.ceil(math.ceil(n / world_size) / batch_size)
            out.append(Period(p, *self.times[p], rows=n, first_batch=first, batches=batches))
            first += batches
        return out

    def batch_bounds(self, rank: int, world_size: int, batch_size: int) -> list[tuple[int, int]]:
        """Rank ``rank``'s batches of an epoch as ``[start, stop)`` ranges of the time order, period by period."""
        out: list[tuple[int, int]] = []
        for period in self.periods(world_size, batch_size):
            lo = int(self.bounds[period.index])
            a, b = cut(period.rows, world_size)[rank : rank + 2]
            edges = cut(b - a, period.batches)
            out += [(lo + a + x, lo + a + y) for x, y in zip(edges[:-1], edges[1:])]
        return out


def time_order(stamps: Sequence[np.ndarray], tz: str | None, period: str | int, column: str = "") -> TimeOrder:
    """The rows' time order and periods from their times (one array per unit, in the files' order: numbers, read as
    seconds since 1970 for a calendar period, or ``datetime64``, UTC where ``tz`` names the column's zone).

    Raises:
        ValueError: a number column with values too large to be seconds (a calendar period), naming ``column``.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    flat = np.concatenate(list(stamps)) if stamps else np.zeros(0)
    order = np.argsort(flat, kind="stable")
    in_order = bool(np.all(order == np.arange(len(order))))
    ordered = flat if in_order else flat[order]
    times = flat.dtype.kind == "M"
    if isinstance(period, int):
        bounds = np.array(list(range(0, len(ordered), period)) + [len(ordered)], dtype=np.int64)
        events = [(_event(ordered[a], tz), _event(ordered[b - 1], tz)) for a, b in zip(bounds[:-1], bounds[1:])]
        return TimeOrder(None if in_order else order, bounds, [(f, last, f, last) for f, last in events], {})
    if times:
        micros = ordered.astype("datetime64[us]").astype(np.int64)
    else:
        if len(ordered) and np.abs(ordered).max() > _MAX_SECONDS:
            raise ValueError(
                f"TabularDataModule: period {period!r}: column {column!r} holds numbers up to {ordered.max():.6g}; "
                "a number column is read as seconds since 1970, and that many seconds is after the year 5000. HINT: "
                "store seconds, or the column as an Arrow timestamp (with its time zone)."
            )
        micros = np.round(ordered * 1e6).astype(np.int64)
    zone = tz if times else "UTC"
    arr = pa.array(micros, pa.timestamp("us", tz="UTC" if zone else None))
    if zone and zone != "UTC":
        arr = arr.cast(pa.timestamp("us", tz=zone))
    floors = pc.floor_temporal(arr, unit=period, week_starts_monday=True)
    keys = floors.cast(pa.int64()).to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, dtype=np.int64)
    bounds = np.r_[starts, len(keys)].astype(np.int64)
    out = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        first = _event(ordered[a], tz) if times else _number(ordered[a])
        last = _event(ordered[b - 1], tz) if times else _number(ordered[b - 1])
        start = floors[a].as_py()
        out.append((start.isoformat(), _after(start, period, zone).isoformat(), first, last))
    return TimeOrder(None if in_order else order, bounds, out, {})


def _after(start: datetime, period: str, zone: str | None) -> datetime:
    """The end of the calendar period that begins at ``start``: an hour later, or the local midnight a day or a week
    later (a 23- or 25-hour day across a daylight saving change)."""
    if period == "hour":
        return start + timedelta(hours=1)  # aware datetimes add in absolute time
    day = start.date() + timedelta(days=7 if period == "week" else 1)
    midnight = datetime(day.year, day.month, day.day)
    tz = start.tzinfo  # the start's zone as pyarrow gives it (zoneinfo, a fixed offset, or pytz's, which localizes)
    if not zone or tz is None:
        return midnight
    return tz.localize(midnight) if hasattr(tz, "localize") else midnight.replace(tzinfo=tz)


def _iso(scalar: Any) -> str:
    return str(scalar.as_py().isoformat())


def _number(x: Any) -> float | int:
    x = float(x)
    return int(x) if x.is_integer() else x


def _event(x: Any, tz: str | None) -> Any:
    """A row's time as the column holds it: a number, or an ISO date-time (in the column's zone)."""
    if not isinstance(x, np.datetime64):
        return _number(x)
    import pyarrow as pa

    micros = int(x.astype("datetime64[us]").astype(np.int64))
    scalar = pa.scalar(micros, pa.timestamp("us", tz="UTC" if tz else None))
    if tz:
        scalar = scalar.cast(pa.timestamp("us", tz=tz))
    return _iso(scalar)
