"""Streaming a table larger than memory: Parquet row groups and CSV byte ranges ("units") split across ranks and
DataLoader workers so that every rank runs the same number of batches and every row is read once per epoch.

How an epoch is cut (:class:`TableStream`):

1. The units are listed once with their row counts (Parquet metadata; a CSV file is indexed by one pass that counts
   its lines and cuts it into byte ranges of about ``chunk_bytes`` at line ends; a gzip file is one unit).
2. Each epoch orders the units by a seeded shuffle (``seed + epoch``); the rows, in that order, are cut into
   ``world_size`` contiguous ranges whose sizes differ by at most one, and each range into the same number of batches
   (sizes differ by at most one): :func:`~lightning_rec.data.base.rank_batches`' rule, so every rank steps together.
3. A rank's batches are dealt to its DataLoader workers in contiguous runs; a worker reads its rows ``window``
   batches at a time (a bounded buffer), permutes them (seeded by seed, epoch, rank and window) and yields batches.
4. :class:`StreamLoader` keeps how many batches it served in its ``state_dict``; Lightning saves it in mid-epoch
   checkpoints and, on resume, the stream starts at the next batch (each worker skips whole windows unread). Which
   rows a batch holds depends on the rank and worker counts: a mid-epoch checkpoint resumed with other counts
   (ranks, workers, batch size) reads the rest of the epoch elastically: the rows the saved layout read are dropped
   and the others cut over the new ranks and workers as above (:mod:`lightning_rec.data.elastic`; the stream's
   ``legs``). Only a change of ``window`` (it decides which rows a half-read window held) is refused, by name.
5. The DataLoader's workers persist across epochs and validations (a fresh worker imports the package, opens the
   files and builds its state: seconds, every pass), and are forked from a fork server that imported the package
   once per process. Each worker holds the copy of the stream it was started with;
   the epoch, the batches to skip and whether the pass reads an elastic resume's remainder live in a small
   shared-memory tensor that the main process writes before each pass and every worker reads when the pass starts.

Only the columns the schema names are read; a worker holds one window of rows and one unit at a time.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_rec._forkserver import worker_context
from lightning_rec.data._filesystems import first_line, open_file, parquet_file, size, source
from lightning_rec.data.elastic import Leg, Remaining, cut, stream_read
from lightning_rec.data.periods import Period, TimeOrder
from lightning_rec.data.resume import ResumableLoader, pass_through
from lightning_rec.errors import CheckpointError

__all__ = ["StreamLoader", "TableStream", "Unit", "list_units", "read_unit"]


@dataclass(frozen=True)
class Unit:
    """A piece of a file read at once: a Parquet row group, or a CSV byte range (``start``/``end``; ``None`` for a
    whole gzip file) whose first row is on ``first_line``."""

    file: str
    rows: int
    row_group: int | None = None
    start: int | None = None
    end: int | None = None
    first_line: int | None = None


def _csv_header(path: str) -> tuple[bytes, int]:
    header = first_line(path)
    return header, len(header)


def list_units(files: Sequence[str], chunk_bytes: int = 32 << 20, header: bool = True) -> list[Unit]:
    """The units of ``files`` with their row counts (one pass over each CSV file, none over Parquet).

    Example::

        units = list_units(["clicks/part-0.parquet", "log.csv"])
        sum(u.rows for u in units)     # rows in all
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    units: list[Unit] = []
    for path in files:
        if path.endswith((".parquet", ".pq")):
            try:
                meta = pq.ParquetFile(source(path)).metadata
            except (pa.ArrowInvalid, OSError) as err:  # pyarrow's message names no file
                if isinstance(err, (FileNotFoundError, PermissionError)) and "://" in path:
                    raise  # a bucket's error, named by the filesystem layer
                from lightning_rec.data.schema import DataError

                raise DataError(f"{path}: not a readable Parquet file ({err}).") from None
            units += [Unit(path, meta.row_group(g).num_rows, row_group=g) for g in range(meta.num_row_groups)]
        elif path.endswith(".gz"):
            with open_file(path) as raw, gzip.open(raw) as f:
                lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b""))
            units.append(Unit(path, lines - int(header), first_line=1 + int(header)))
        else:
            units += _csv_units(path, chunk_bytes, header)
    return units


def _csv_units(path: str, chunk_bytes: int, header: bool) -> list[Unit]:
    total = size(path)
    start = _csv_header(path)[1] if header else 0
    line = 1 + int(header)
    units = []
    with open_file(path) as f:
        f.seek(start)
        while start < total:
            f.seek(min(start + chunk_bytes, total))
            f.readline()  # to the end of the line the cut falls in
            end = min(f.tell(), total)
            f.seek(start)
            block = f.read(end - start)
            rows = block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
            units.append(Unit(path, rows, start=start, end=end, first_line=line))
            line += rows
            start = end
    return units


def read_unit(
    unit: Unit,
    columns: Sequence[str],
    csv_columns: Sequence[str] | None,
    delimiter: str | None,
    null_values: Sequence[str] | None = None,
) -> Any:
    """The ``columns`` of ``unit`` as a ``pyarrow.Table``; ``null_values``: the CSV fields that are nulls, in every
    column (``None``: pyarrow's default tokens, in numeric columns only)."""
    import pyarrow.csv as pacsv

    if unit.row_group is not None:
        return parquet_file(unit.file).read_row_group(unit.row_group, columns=list(columns))
    sep = delimiter or ("\t" if ".tsv" in unit.file else ",")
    names = list(csv_columns) if csv_columns else next(csv.reader([_csv_header(unit.file)[0].decode()], delimiter=sep))
    missing = [c for c in columns if c not in names]
    if missing:
        from lightning_rec.data.schema import DataError

        raise DataError(f"{unit.file}: no column {', '.join(map(repr, missing))} (it has {names}).")
    if unit.start is None:
        with open_file(unit.file) as raw, gzip.open(raw) as f:
            data = f.read()
        if not csv_columns:
            data = data.split(b"\n", 1)[1] if b"\n" in data else b""
    else:
        with open_file(unit.file) as f:
            f.seek(unit.start)
            assert unit.end is not None  # a byte range has both ends
            data = f.read(unit.end - unit.start)
    table = pacsv.read_csv(
        io.BytesIO(data),
        read_options=pacsv.ReadOptions(column_names=names),
        parse_options=pacsv.ParseOptions(delimiter=sep),
        convert_options=pacsv.ConvertOptions(include_columns=list(columns))
        if null_values is None
        else pacsv.ConvertOptions(
            include_columns=list(columns), null_values=list(null_values), strings_can_be_null=True
        ),
    )
    return table.select(list(columns))


_cut = cut  # the stream's cut of rows into ranks and batches, and of batches into workers' runs


class TableStream(IterableDataset):
    """One rank's batches of one split, streamed (see the module docstring).

    Args:
        units: the split's units (:func:`list_units`).
        read: ``read(unit, first_row, stop_row)`` -> a dataset of those rows indexed by row batches
            (``dataset[index_tensor] -> Batch``), built columnar by the DataModule.
        batch_size, rank, world_size: batching (every rank gets the same number of batches).
        shuffle, seed: seeded unit order and window permutation (reshuffled every epoch).
        window: batches a worker buffers and permutes at once.
        time: the rows' time order and periods (:mod:`lightning_rec.data.periods`): the epoch replays them in time
            order, period by period (no shuffling; each period's rows cut over the ranks and into batches as an
            epoch's are, see :attr:`periods`); a worker reads ``window`` batches at a time.

    Attributes:
        legs: the earlier legs of an elastically resumed epoch (:mod:`lightning_rec.data.elastic`; set by
            :class:`~lightning_rec.data.resume.ResumableLoader` before the pass's workers start); the next pass of
            that epoch reads only the rows they left, cut over this stream's rank count and workers.
    """

    def __init__(
        self,
        units: Sequence[Unit],
        read: Callable[[Unit, int, int], Any],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        window: int = 8,
        time: TimeOrder | None = None,
    ) -> None:
        self.units, self.read = list(units), read
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.shuffle, self.seed, self.window = shuffle, seed, max(1, window)
        # [epoch, batches of this leg of the epoch already served (a resumed epoch), 1 if the pass reads what `legs`
        # left], in shared memory: a persistent worker's copy of this stream reads the values the main process set for
        # the pass it starts (see the module docstring).
        self._position = torch.zeros(3, dtype=torch.int64).share_memory_()
        self._legs: list[Leg] = []
        self.time = time
        total = sum(u.rows for u in self.units) if time is None else time.rows
        if total < world_size:
            raise ValueError(f"Cannot give each of {world_size} ranks at least one of {total} rows.")
        self.total_rows = total
        self.num_batches = math.ceil(math.ceil(total / world_size) / batch_size)
        self.periods: list[Period] = []
        if time is not None:
            self.shuffle = False  # time order is the order
            self.periods = time.periods(world_size, batch_size)
            self.num_batches = sum(p.batches for p in self.periods)
            kept = [int(time.kept[k].sum()) if k in time.kept else u.rows for k, u in enumerate(self.units)]
            self._kept_offsets = np.cumsum([0] + kept)

    def __len__(self) -> int:
        if not self.elastic:
            return self.num_batches
        return self._legs[-1].served + self._leg_batches(self.rows_left(self.epoch, self._legs))

    def _leg_batches(self, n: int) -> int:
        return math.ceil(math.ceil(n / self.world_size) / self.batch_size)

    @property
    def legs(self) -> list[Leg]:
        """The earlier legs of the epoch the next pass resumes (empty: a whole epoch, or a same-layout resume)."""
        if self.elastic and not self._legs:  # a worker started before they were set would read rows twice
            raise RuntimeError(
                "TableStream: this DataLoader worker started before the elastic resume's legs were set; load the "
                "loader's state before its first pass (Lightning does)."
            )
        return list(self._legs) if self.elastic else []

    @legs.setter
    def legs(self, legs: Sequence[Leg]) -> None:
        self._legs = list(legs)  # in this process: a persistent worker keeps the copy it started with
        self._position[2] = int(bool(legs))

    @property
    def elastic(self) -> bool:
        """Whether the next pass reads what earlier legs of its epoch left (see :attr:`legs`)."""
        return bool(self._position[2])

    def rows_left(self, epoch: int, legs: Sequence[Leg]) -> int:
        """How many rows of ``epoch`` the ``legs`` left unread.

        Raises:
            CheckpointError: a time-ordered stream: its epoch resumes on the layout it was saved with only.
        """
        if self.time is not None:
            leg = legs[-1] if legs else None
            saved = f" (saved with {leg.world_size} process(es), batch_size {leg.batch_size})" if leg else ""
            raise CheckpointError(
                f"TableStream: the checkpoint was saved in the middle of a time-ordered epoch (period){saved}; this "
                f"run has {self.world_size} process(es), batch_size {self.batch_size}, and a period's batches depend "
                "on both. HINT: resume with the rank count, batch_size and num_workers it was saved with, or from a "
                "checkpoint saved at the end of an epoch."
            )
        return len(self.remaining(epoch, legs))

    def remaining(self, epoch: int, legs: Sequence[Leg]) -> Remaining:
        """The positions of ``epoch``'s row order that ``legs`` (saved layouts, in turn) did not read."""
        left = Remaining.whole(self.total_rows)
        before = 0
        for number, leg in enumerate(legs):

            def permutation(rank: int, w0: int, rows: int, number: int = number) -> np.ndarray:
                return self._permutation(epoch, number, rank, w0, rows).numpy()

            read = stream_read(
                len(left), leg, leg.served - before, self.window, permutation if self.shuffle else None, _served_by
            )
            left, before = left.without(read), leg.served
        return left

    def _permutation(self, epoch: int, leg: int, rank: int, w0: int, rows: int) -> torch.Tensor:
        """The order of a window's rows (seeded by seed, epoch, rank, window and, after an elastic resume, leg)."""
        key = ((self.seed * 1_000_003 + epoch) * 1_000_003 + rank) * 1_000_003 + w0
        if leg:
            key = key * 1_000_003 + leg
        return torch.randperm(rows, generator=torch.Generator().manual_seed(key & 0x7FFF_FFFF_FFFF))

    @property
    def epoch(self) -> int:
        """The epoch the next pass reads (its unit order and permutations)."""
        return int(self._position[0])

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self._position[0] = epoch

    @property
    def start_batch(self) -> int:
        """How many of the epoch's first batches the next pass skips (a resumed epoch)."""
        return int(self._position[1])

    @start_batch.setter
    def start_batch(self, batches: int) -> None:
        self._position[1] = batches

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (Lightning calls it on samplers; :class:`StreamLoader` calls it here)."""
        self.epoch = epoch

    def _order(self, epoch: int) -> list[Unit]:
        if not self.shuffle:
            return list(self.units)
        perm = torch.randperm(len(self.units), generator=torch.Generator().manual_seed(self.seed + epoch))
        return [self.units[i] for i in perm.tolist()]

    def batch_bounds(self, rows: int | None = None) -> list[tuple[int, int]]:
        """This rank's batches as ``[start, stop)`` row ranges of the epoch's row order (of ``rows`` rows: the
        rows an elastic resume left, in their order; default all)."""
        rows = self.total_rows if rows is None else rows
        lo, hi = _cut(rows, self.world_size)[self.rank : self.rank + 2]
        edges = _cut(hi - lo, self._leg_batches(rows))
        return [(lo + a, lo + b) for a, b in zip(edges[:-1], edges[1:])]

    def worker_runs(self, workers: int, rows: int | None = None) -> list[tuple[int, int]]:
        """Each worker's contiguous run of batch numbers ``[first, stop)``."""
        edges = _cut(self._leg_batches(self.total_rows if rows is None else rows), workers)
        return list(zip(edges[:-1], edges[1:]))

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        physical, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, start = self.epoch, self.start_batch  # read once: the main process set them for this pass
        if self.time is not None:
            yield from self._in_time_order(physical, workers, start)
            return
        legs = self.legs
        left = self.remaining(epoch, legs) if legs else None
        rows = self.total_rows if left is None else len(left)
        runs = self.worker_runs(workers, rows)
        done, turn = _served_by(start, [b - a for a, b in runs])
        # The DataLoader asks its workers in turn from worker 0: on a resumed epoch, worker 0 plays the part whose
        # turn is next, so the batches keep the order of the uninterrupted epoch.
        worker = (physical + turn) % workers
        first, stop = runs[worker]
        skip = done[worker]
        bounds = self.batch_bounds(rows)
        order = self._order(epoch)
        offsets = np.cumsum([0] + [u.rows for u in order])
        for w0 in range(first, stop, self.window):
            w1 = min(w0 + self.window, stop)
            if w1 - first <= skip:
                continue  # a resumed epoch: this window was served before the checkpoint
            lo, hi = bounds[w0][0], bounds[w1 - 1][1]
            if left is None:
                window = self._rows(order, offsets, lo, hi)
            else:  # an elastic resume's leg: its rows, where they are in the epoch's order
                parts = [self._rows(order, offsets, a, b) for a, b in left.ranges(lo, hi)]
                window = parts[0] if len(parts) == 1 else _cat_datasets(parts)
            perm = (
                self._permutation(epoch, len(legs), self.rank, w0, hi - lo) if self.shuffle else torch.arange(hi - lo)
            )
            for b in range(w0, w1):
                if b - first < skip:
                    continue
                a, z = bounds[b][0] - lo, bounds[b][1] - lo
                yield window[perm[a:z]]

    def _in_time_order(self, physical: int, workers: int, start: int) -> Iterator[Any]:
        """This worker's batches of a time-ordered epoch (from batch ``start`` of the rank's), ``window`` batches
        read at a time; a window's batches that are contiguous in time order are read as one range."""
        assert self.time is not None
        bounds = self.time.batch_bounds(self.rank, self.world_size, self.batch_size)
        edges = _cut(len(bounds), workers)
        runs = list(zip(edges[:-1], edges[1:]))
        done, turn = _served_by(start, [b - a for a, b in runs])
        worker = (physical + turn) % workers  # as in __iter__: the resumed epoch keeps the uninterrupted order
        first, stop = runs[worker]
        for w0 in range(first + done[worker], stop, self.window):
            batches = bounds[w0 : min(w0 + self.window, stop)]
            ranges: list[list[int]] = []
            for a, b in batches:
                if ranges and ranges[-1][1] == a:
                    ranges[-1][1] = b
                else:
                    ranges.append([a, b])
            parts = [self._time_rows(a, b) for a, b in ranges]
            window = parts[0] if len(parts) == 1 else _cat_datasets(parts)
            at = 0
            for a, b in batches:
                yield window[torch.arange(at, at + b - a)]
                at += b - a

    def _time_rows(self, lo: int, hi: int) -> Any:
        """Rows ``[lo, hi)`` of the time order, one dataset: each unit they fall in read once, over the range that
        holds them, then put in time order."""
        assert self.time is not None
        order, kept, offsets = self.time.order, self.time.kept, self._kept_offsets
        positions = np.arange(lo, hi) if order is None else order[lo:hi]
        unit_of = np.searchsorted(offsets, positions, side="right") - 1
        parts = []
        for k in np.unique(unit_of).tolist():
            local = np.sort(positions[unit_of == k]) - offsets[k]  # kept rows of the unit
            raw = local if k not in kept else np.flatnonzero(kept[k])[local]
            a, b = int(raw[0]), int(raw[-1]) + 1
            part = self.read(self.units[k], a, b)
            # the rows of [a, b): all of them, or (a reader that drops bad rows) the kept ones
            index = raw - a if len(part) == b - a else local - local[0]
            if len(index) != len(part):
                part = part.subset(torch.from_numpy(index))
            parts.append(part)
        rows = parts[0] if len(parts) == 1 else _cat_datasets(parts)
        if order is None:
            return rows
        place = np.empty(len(positions), dtype=np.int64)  # rows are in the order of their positions: time order
        place[np.argsort(positions, kind="stable")] = np.arange(len(positions))
        return rows.subset(torch.from_numpy(place))

    def _rows(self, order: list[Unit], offsets: np.ndarray, lo: int, hi: int) -> Any:
        """Rows ``[lo, hi)`` of the epoch's order, one dataset (units read in turn, sliced)."""
        first = int(np.searchsorted(offsets, lo, side="right")) - 1
        parts = []
        i = first
        while i < len(order) and offsets[i] < hi:
            a, b = max(lo, offsets[i]) - offsets[i], min(hi, offsets[i + 1]) - offsets[i]
            parts.append(self.read(order[i], int(a), int(b)))
            i += 1
        return parts[0] if len(parts) == 1 else _cat_datasets(parts)


def _cat_datasets(parts: Sequence[Any]) -> Any:
    """The rows of ``parts`` (``RecDataset`` s of one source) as one dataset of their type."""
    sparse: dict[str, Any] = {}
    weights: dict[str, Any] = {}
    for name, col in parts[0].sparse.items():
        if isinstance(col, torch.Tensor):  # one id per row
            sparse[name] = torch.cat([p.sparse[name] for p in parts])
        else:  # a Jagged column
            sparse[name] = _cat_jagged([p.sparse[name] for p in parts])
            if name in parts[0].weights:
                weights[name] = _cat_jagged([p.weights[name] for p in parts])
    return type(parts[0])(
        torch.cat([p.dense for p in parts]), torch.cat([p.labels for p in parts]), sparse, weights or None
    )


def _cat_jagged(cols: Sequence[Any]) -> Any:
    """Jagged columns one after the other, as one of their type."""
    values = torch.cat([c.values for c in cols])
    shifts = np.cumsum([0] + [int(c.offsets[-1]) for c in cols[:-1]])
    offsets = torch.cat([cols[0].offsets[:1]] + [c.offsets[1:] + int(s) for c, s in zip(cols, shifts)])
    return type(cols[0])(values, offsets)


def _served_by(served: int, counts: Sequence[int]) -> tuple[list[int], int]:
    """How many of the first ``served`` batches each worker yielded, and whose turn is next, the DataLoader taking
    one batch from each worker in turn (skipping workers that are done).

    Example::

        >>> _served_by(5, [3, 3])
        ([3, 2], 1)
    """
    done = [0] * len(counts)
    turn = 0
    for _ in range(served):
        while done[turn % len(counts)] >= counts[turn % len(counts)]:
            turn += 1
        done[turn % len(counts)] += 1
        turn += 1
    return done, turn % len(counts)


class StreamLoader(ResumableLoader):
    """A DataLoader over a :class:`TableStream` that Lightning can resume mid-epoch: it counts the batches it served
    (``state_dict``) and, after ``load_state_dict``, starts the epoch at the next one (see
    :class:`~lightning_rec.data.resume.ResumableLoader`; the stream's worker count is part of its layout). Its workers
    persist across epochs and validations (``persistent_workers``; the stream's shared position tells them each
    pass's epoch and start).

    Attribute access and ``len()`` go to the DataLoader.
    """

    def __init__(self, stream: TableStream, num_workers: int = 0, pin_memory: bool = False) -> None:
        dataloader = DataLoader(
            stream,
            batch_size=None,
            collate_fn=pass_through,
            num_workers=num_workers,
            multiprocessing_context=worker_context() if num_workers > 0 else None,
            persistent_workers=num_workers > 0,
            pin_memory=pin_memory,
        )
        super().__init__(
            dataloader,
            stream,
            world_size=stream.world_size,
            batch_size=stream.batch_size,
            num_workers=num_workers,
            workers_matter=True,
        )
        self.stream = stream

    def __len__(self) -> int:
        return len(self.stream)
