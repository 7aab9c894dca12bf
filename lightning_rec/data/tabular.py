"""Your own data: Parquet and CSV tables read through a declared :class:`~lightning_rec.data.schema.Schema`.

Example (YAML)::

    data:
      class_path: lightning_rec.data.TabularDataModule
      init_args:
        files: [data/clicks/*.parquet]                 # or train/val/test: one list of files or globs per split
        split: {random: {val: 0.1, test: 0.1, seed: 42}}
        schema:
          labels: [{column: clicked}]
          dense: [{column: price, transform: log1p}]
          sparse:
            - {column: user_id, ids: hash, num_embeddings: 1000000}
            - {column: item_id, ids: vocab}

Files: Parquet (``.parquet``/``.pq``, read with ``pyarrow``), CSV/TSV (``.csv``/``.tsv``/``.txt``, optionally
``.gz``; a header line names the columns, or ``csv_columns`` does; the fields in ``csv_null_values``, by default only
empty ones, are missing values). Splits: one list of files per split, or one list and a rule:
``{random: {val, test, seed}}`` (the seeded two-stage holdout of :class:`~lightning_rec.data.MovieLensDataModule`) or
``{timestamp: {column, val_from, test_from}}``: ``val_from``/``test_from`` are numbers in the column's own unit, or,
for an Arrow timestamp or date column (or ISO dates in CSV), ISO dates or date-times (``"2026-11-12"``,
``"2026-11-12T08:00:00"``; in the column's time zone, if it has one). Every rule is checked against the data when
:meth:`TabularDataModule.check` runs (``sparse_features`` runs it: in the main process, before any other process
starts): a split left empty, or ``test_from`` before ``val_from``, is refused naming the column's first and last
value.

The rows are read into columns (no Python per row) and batched by
:class:`~lightning_rec.data.base.DistributedBatchSampler`: every rank runs the same number of batches, every row is
used once per epoch. What the training split teaches (``vocab`` vocabularies, ``standardize`` statistics) is
computed once, kept in the DataModule's ``state_dict`` (so Lightning saves it inside every checkpoint and restores it
with ``ckpt_path``, and predictions map ids the same way) and, with ``state_dir``, written there as files.

Bad data is refused before training, naming the file, the row group (Parquet) or line (CSV), the column and the
value: an empty or header-only file, a missing column, a column of the wrong type, a CSV field that is not a number
where one was expected, a null id, NaN or inf in a dense column, a weight list whose length differs from its id list.
``bad_rows: drop`` drops such rows instead (not missing or mistyped columns) and counts them in ``dropped_rows``;
``fill`` fills missing (null or NaN) dense values with a constant or the training split's mean. How many rows each
split has, dropped and filled, is logged (and kept in ``row_counts``).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_rec._choices import check_arguments
from lightning_rec.config import SparseFeature
from lightning_rec.data._tabular_read import (
    Decoded,
    Mapper,
    Part,
    UnitReader,
    _Bad,
    _stamps,
    column_names,
    concat_jagged,
    decode,
    expand,
    not_empty,
    open_parquet,
    read_table,
    rows_of,
    take,
    where,
)
from lightning_rec.data._tabular_split import SplitRule, fill_spec, known, split_rows
from lightning_rec.data.base import RecDataModule, RecDataset
from lightning_rec.data.periods import Period, TimeOrder, check_period, time_order
from lightning_rec.data.schema import DataError, Schema, SparseColumn, Vocabulary, id_text
from lightning_rec.data.stream import TableStream, Unit, list_units, read_unit

__all__ = ["TabularDataModule"]

_SPLITS = ("train", "val", "test")
_PARQUET_SUFFIXES = (".parquet", ".pq")


class TabularDataModule(RecDataModule):
    """Parquet/CSV files through a declared schema (see the module docstring).

    Args:
        schema: the columns (a :class:`~lightning_rec.data.schema.Schema` or its dict from YAML).
        files: files or globs holding every split, split by ``split``.
        train, val, test: files or globs per split (instead of ``files`` + ``split``); without ``test`` the
            validation split is tested.
        split: the rule that splits ``files`` (a :class:`SplitRule` or its dict).
        csv_columns: the column names of CSV files without a header line.
        csv_delimiter: the CSV field separator (default ``,``; ``\\t`` for ``.tsv``).
        bad_rows: ``"error"`` (default) or ``"drop"`` (counted in :attr:`dropped_rows` and :attr:`row_counts`).
        state_dir: a directory to also write the vocabularies and statistics to (``vocab_<feature>.txt``,
            ``dense_stats.json``, ``fill_means.json``); they are always in the DataModule's ``state_dict``.
        batch_size, num_workers, seed: see :class:`~lightning_rec.data.base.RecDataModule`.
        fill: what missing (null or NaN) dense values become, instead of bad rows: a number, ``"mean"`` (the
            training split's mean of the values present, kept in the ``state_dict``), or either per dense column
            (``{price: 0.0, age: mean}``; columns not named stay checked). Counted per split in :attr:`row_counts`.
        csv_null_values: the CSV fields that are missing values, in every column (default ``[""]``: only empty
            fields). Anything else in a numeric column that is not a number is refused, naming line and value.
        predict_files: files or globs to score: the ``predict`` split (default: the validation split). Their label
            columns are optional; the schema's ``keys`` are read from them (see "Score a file" in docs/data.md).
            Read and checked with the other files; ids map through what the training split taught (or, with
            ``ckpt_path``, the checkpoint's vocabularies and statistics).
        period: replay the training rows in time order, period after period: ``"hour"``, ``"day"``, ``"week"``
            (calendar periods of ``time_column``, weeks from Monday) or a number of rows. No shuffling; ties keep
            the files' order; every rank is in the same period at every step and no batch holds two periods
            (:attr:`periods`, :mod:`lightning_rec.data.periods`). In memory or streamed.
        time_column: the column ``period`` orders by (default: ``split.timestamp.column``, else the training files'
            only Arrow timestamp or date column, else their column ``timestamp``): an Arrow timestamp or date column
            (in its time zone, if it has one; CSV: ISO date-times), or numbers, read as seconds since 1970 for a
            calendar period.

    Example::

        dm = TabularDataModule(schema={"labels": [{"column": "click"}], "sparse": [{"column": "user", "ids": "vocab"}]},
                               files=["clicks.parquet"], split={"random": {"val": 0.1, "test": 0.0, "seed": 0}})
        dm.sparse_features    # reads and checks the files: [SparseFeature(name='user', num_embeddings=..., ...)]
        dm.row_counts         # {'files': {'read': ..., 'dropped': 0}, 'train': {'rows': ..., 'filled': {}}, ...}
    """

    def __init__(
        self,
        schema: Schema | Mapping[str, Any],
        files: str | list[str] | None = None,
        train: str | list[str] | None = None,
        val: str | list[str] | None = None,
        test: str | list[str] | None = None,
        split: SplitRule | Mapping[str, Any] | None = None,
        csv_columns: list[str] | None = None,
        csv_delimiter: str | None = None,
        bad_rows: Literal["error", "drop"] = "error",
        state_dir: str | None = None,
        stream: bool = False,
        window: int = 8,
        chunk_bytes: int = 32 << 20,
        batch_size: int = 512,
        num_workers: int = 0,
        seed: int = 0,
        fill: float | Literal["mean"] | dict[str, float | Literal["mean"]] | None = None,
        csv_null_values: list[str] | None = None,
        predict_files: str | list[str] | None = None,
        period: Literal["hour", "day", "week"] | int | None = None,
        time_column: str | None = None,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.stream, self.window, self.chunk_bytes = stream, window, chunk_bytes
        if stream and files is not None:
            raise ValueError(
                "TabularDataModule(stream=True) reads one list of files per split: give train (and val/test) "
                "instead of files + split."
            )
        self.schema = schema if isinstance(schema, Schema) else Schema(**dict(schema))
        if (files is None) == (train is None):
            raise ValueError("TabularDataModule: give either `files` (with a `split` rule) or `train` (and val/test).")
        if files is not None and split is None:
            raise ValueError("TabularDataModule: `files` needs a `split` rule, e.g. {random: {val: 0.1, test: 0.1}}.")
        if split is not None and not isinstance(split, SplitRule):
            known("split", split, ("random", "timestamp"))
        self.split_rule = split if split is None or isinstance(split, SplitRule) else SplitRule(**dict(split))
        self.fill = fill_spec(fill, [c.column for c in self.schema.dense])
        self.period = check_period(period)
        period = self.period  # type: ignore[assignment]  # "1000" (a CLI's text) is 1000 rows, for check_arguments
        self.time_column = self._time_column(time_column)
        check_arguments(TabularDataModule.__init__, "TabularDataModule", locals())  # a misspelled choice, named
        if csv_null_values is not None and not all(isinstance(v, str) for v in csv_null_values):
            raise ValueError(f"TabularDataModule: csv_null_values is {csv_null_values!r}: a list of strings.")
        self.csv_null_values = [""] if csv_null_values is None else list(csv_null_values)
        self.sources = {"all": files} if files is not None else {"train": train, "val": val, "test": test}
        if predict_files is not None:
            self.sources["predict"] = predict_files
        self.csv_columns, self.csv_delimiter = csv_columns, csv_delimiter
        self.bad_rows = bad_rows
        self.state_dir = state_dir
        self.dropped_rows = 0
        # per source ("files", or a split's own files): rows read and dropped; per split: rows and filled values
        self.row_counts: dict[str, dict[str, Any]] = {}
        self.vocabularies: dict[str, Vocabulary] = {}
        self.dense_stats: dict[str, tuple[float, float]] = {}
        self.fill_means: dict[str, float] = {}
        self._splits: dict[str, RecDataset] = {}
        self._decoded: dict[str, Decoded] | None = None
        self._unit_lists: dict[str, list[Unit]] = {}
        # streaming with bad_rows: drop: per split, per unit (its index) with bad rows, which of its rows are kept
        self._kept_rows: dict[str, dict[int, np.ndarray]] = {}
        self._stamp_tz: str | None = None
        self._time: TimeOrder | None = None
        self._checked = False

    def _time_column(self, given: str | None) -> str | None:
        """The column ``period`` orders by: ``time_column``, else the timestamp split's."""
        ruled = self.split_rule.timestamp["column"] if self.split_rule and self.split_rule.timestamp else None
        if given is not None and self.period is None:
            raise ValueError(
                f"TabularDataModule: time_column {given!r} is read only to order the rows by time: give a period "
                "too (period: hour, day, week or a number of rows)."
            )
        if given is not None and ruled is not None and given != ruled:
            raise ValueError(
                f"TabularDataModule: time_column {given!r} and split.timestamp.column {ruled!r}: the rows are split "
                "and ordered by one time column. HINT: leave time_column out to order by the split's."
            )
        return given or ruled

    # ---- what the model needs --------------------------------------------------------------------------------
    @property
    def sparse_features(self) -> list[SparseFeature]:
        self.check()
        return self.schema.sparse_features({table: len(v) for table, v in self.vocabularies.items()})

    def check(self) -> None:
        """Read and check every file and split rule, learn what the training split teaches and log each split's
        rows (dropped, filled), once. :attr:`sparse_features` runs it, so under the CLI (or any script that builds
        its model from ``sparse_features``) bad data and split rules are refused in the main process, before the
        strategy starts any other; ``setup`` runs it too. Streaming, it lists every split's row groups and byte
        ranges (empty files are refused) and reads the training files only if there is something to learn.

        Raises:
            DataError: bad data, naming file, row group or line, column and value.
            ValueError: a split rule that leaves a split empty, naming the setting and the column's range.
        """
        if self._checked:
            return
        if self.period is not None and self.time_column is None:
            self.time_column = self._found_time_column()
        if self.stream:
            for split, patterns in self.sources.items():
                if patterns is not None:
                    self._units(split)
            predict = self.sources.get("predict")
            if predict is not None and not self._labeled(expand(predict, "predict")):
                raise DataError(
                    f"TabularDataModule(stream=True): the files to score ({predict!r}) have no label column "
                    f"{', '.join(repr(c.column) for c in self.schema.labels)}: a stream reads labels. HINT: "
                    "`stream: false` scores files without labels."
                )
        else:
            self._read()
        if self.period is not None:
            self._time = self._time_order()
        self._learn()
        self._report()
        self._checked = True

    def _found_time_column(self) -> str:
        """The column ``period`` orders by when ``time_column`` is not given: the first training file's only Arrow
        timestamp or date column, else its column named ``timestamp``.

        Raises:
            ValueError: neither, naming the file's columns.
        """
        import pyarrow as pa

        source = "train" if self.sources.get("train") is not None else "all"
        patterns = self.sources[source]
        assert patterns is not None  # train, or files (with a split rule)
        first = expand(patterns, source)[0]
        names = column_names(first, self.csv_columns, self.csv_delimiter)
        if first.endswith(_PARQUET_SUFFIXES):
            schema = open_parquet(first).schema_arrow
            times = [f.name for f in schema if pa.types.is_timestamp(f.type) or pa.types.is_date(f.type)]
            if len(times) == 1:
                rank_zero_info(f"TabularDataModule: period {self.period!r} orders by {times[0]!r}, the time column.")
                return times[0]
        if "timestamp" in names:
            rank_zero_info(f"TabularDataModule: period {self.period!r} orders by the column 'timestamp'.")
            return "timestamp"
        raise ValueError(
            f"TabularDataModule: period {self.period!r} orders the training rows by time, and {first} has no one "
            f"timestamp column nor one named 'timestamp' (its columns: {', '.join(names)}): name it, e.g. "
            "`time_column: ts` (or split the rows with `split: {timestamp: {column: ts, ...}}`)."
        )

    @property
    def periods(self) -> list[Period]:
        """The training split's periods (with ``period``; else ``[]``) and their batches for this run's ranks and
        ``batch_size``: batch ``i`` of an epoch belongs to the period with ``first_batch <= i < first_batch +
        batches``, on every rank. :class:`~lightning_rec.progressive.ProgressiveEvaluation` reads them.

        Raises:
            ValueError: a period has fewer rows than there are ranks.

        Example::

            dm = TabularDataModule(schema=..., train="clicks/", period="day", time_column="ts", stream=True)
            [(p.start, p.rows) for p in dm.periods]   # [('2026-11-01T00:00:00', 5120), ...]
        """
        if self.period is None:
            return []
        self.check()
        assert self._time is not None
        return self._time.periods(self.rank_and_world_size[1], self.batch_size)

    def period_of(self, batch_idx: int) -> Period:
        """The period that batch ``batch_idx`` of a training epoch belongs to (on every rank; see :attr:`periods`).

        Raises:
            ValueError: no ``period`` was declared, or ``batch_idx`` is not a batch of the epoch.

        Example::

            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                print(trainer.datamodule.period_of(batch_idx).start)
        """
        periods = self.periods
        if not periods:
            raise ValueError("TabularDataModule.period_of: the training rows have no periods (declare `period`).")
        index = bisect.bisect_right([p.first_batch for p in periods], batch_idx) - 1
        if batch_idx < 0 or index < 0 or batch_idx >= periods[-1].first_batch + periods[-1].batches:
            last = periods[-1].first_batch + periods[-1].batches
            raise ValueError(
                f"TabularDataModule.period_of: batch {batch_idx} is not one of the epoch's {last} batches."
            )
        return periods[index]

    def _time_order(self) -> TimeOrder:
        """The training rows' time order and periods: from the rows in memory, or (streaming) from one pass over the
        training files' time column (every column with ``bad_rows: drop``, to know which rows are kept)."""
        column, period = self.time_column, self.period
        assert column is not None and period is not None
        if not self.stream:
            train = self._read()["train"]
            assert train.timestamps is not None
            return time_order([train.timestamps], self._stamp_tz, period, column)
        drop = self.bad_rows == "drop"
        stamps: list[np.ndarray] = []
        kept: dict[int, np.ndarray] = {}
        kinds: dict[str, tuple[bool, Any]] = {}
        for k, unit in enumerate(self._units("train")):
            columns = self._columns() if drop else [column]
            table = read_unit(unit, columns, self.csv_columns, self.csv_delimiter, self.csv_null_values)
            part = Part(table, unit.file, where(unit), unit.first_line)
            if drop:
                decoded = decode(part, self.schema, True, column, self.fill)
                assert decoded.timestamps is not None
                stamps.append(decoded.timestamps[decoded.keep])
                if not decoded.keep.all():
                    kept[k] = decoded.keep
            else:
                stamps.append(_stamps(part, column, _Bad(part, False)))
            kinds.setdefault(unit.file, (stamps[-1].dtype.kind == "M", table.column(column).type))
        self._one_kind(column, kinds)
        order = time_order(stamps, self._stamp_tz, period, column)
        order.kept = kept
        return order

    def _report(self, only: str | None = None) -> None:
        fills = self._fills()
        for name, c in self.row_counts.items():
            if only is not None and name != only:
                continue
            said = []
            if "read" in c:
                said.append(f"{c['read']} rows read, {c['dropped']} dropped (bad_rows: {self.bad_rows})")
            if "rows" in c:
                said.append(f"{c['rows']} rows")
            if c.get("labels") is False:
                said.append("no label column: scored without labels")
            for column, n in c.get("filled", {}).items():
                mean = " (the training split's mean)" if self.fill[column] == "mean" else ""
                said.append(f"{n} missing {column!r} filled with {fills[column]:g}{mean}")
            rank_zero_info(f"TabularDataModule: {name}: {'; '.join(said)}.")

    def check_files(self) -> None:
        """What ``lightning-rec fit/validate/test/predict`` calls in the main process before any rank starts: every
        file and split rule checked (:meth:`check`), also under a model that does not read :attr:`sparse_features`.
        """
        self.check()

    @property
    def num_dense_features(self) -> int:
        return len(self.schema.dense)

    @property
    def num_labels(self) -> int:
        """The label columns the schema declares; ``lightning-rec`` refuses a model that takes fewer (a
        :class:`~lightning_rec.models.base.CTRModule` has one head: ``num_labels = 1``) before any rank starts."""
        return len(self.schema.labels)

    # ---- reading ----------------------------------------------------------------------------------------------
    def _columns(self, labels: bool = True, keys: bool = False, stamp: bool = True) -> list[str]:
        column = self._stamp_column()
        extra = [column] if stamp and column else []
        columns = self.schema.columns
        if not labels:  # a file to score without labels: the features' columns
            s = self.schema
            columns = [c.column for c in s.dense] + [x for c in s.sparse for x in (c.column, c.weights) if x]
        return list(dict.fromkeys(columns + extra + (self.schema.keys if keys else [])))

    def _scored(self, source: str) -> bool:
        """Whether ``predict`` scores the rows of ``source``: ``predict_files``, else the validation split's."""
        return source == "predict" or ("predict" not in self.sources and source in ("all", "val"))

    def _labeled(self, files: list[str]) -> bool:
        """Whether the files to score have labels: every file a label column (then every one is needed, as for
        training), or none.

        Raises:
            DataError: some files have a label column and others do not, naming one of each.
        """
        labels = [c.column for c in self.schema.labels]
        has = {f: bool(set(labels) & set(column_names(f, self.csv_columns, self.csv_delimiter))) for f in files}
        if len(set(has.values())) > 1:
            with_ = next(f for f, h in has.items() if h)
            without = next(f for f, h in has.items() if not h)
            raise DataError(
                f"{without}: no label column {', '.join(map(repr, labels))}, but {with_} has one: the files to score "
                "(predict_files) all have their labels, or none has. HINT: score them in two runs."
            )
        return all(has.values())

    @property
    def predict_labeled(self) -> bool:
        """Whether the rows ``predict`` scores have labels (``False``: ``predict_files`` without a label column;
        their batches' labels are 0 and :class:`~lightning_rec.callbacks.ScoreWriter` writes none)."""
        self.check()
        return self.row_counts.get("predict", {}).get("labels", True) is not False

    def _stamp_column(self) -> str | None:
        """The time column read with the rows: the timestamp split's, or the one ``period`` orders by."""
        if self.time_column is not None:
            return self.time_column
        return self.split_rule.timestamp["column"] if self.split_rule and self.split_rule.timestamp else None

    def _read(self) -> dict[str, Decoded]:
        """Every split's rows, decoded and checked (ids not mapped yet, missing values to fill still NaN), and every
        split rule checked against them."""
        if self._decoded is not None:
            return self._decoded
        drop = self.bad_rows == "drop"
        stamp = self._stamp_column()
        out: dict[str, Decoded] = {}
        for name, patterns in self.sources.items():
            if patterns is None:
                continue
            parts: list[Decoded] = []
            kinds: dict[str, tuple[bool, Any]] = {}  # file -> (holds times, its type): one kind in every file
            scored = self._scored(name)
            split_by = stamp if name in ("all", "train") else None  # the rows a rule splits or `period` orders
            files = expand(patterns, name)
            labeled = name != "predict" or self._labeled(files)
            for f in files:
                columns = self._columns(labeled, scored, split_by is not None)
                for p in read_table(f, columns, self.csv_columns, self.csv_delimiter, self.csv_null_values):
                    parts.append(decode(p, self.schema, drop, split_by, self.fill, labels=labeled, keys=scored))
                    stamps = parts[-1].timestamps
                    if stamps is not None:
                        kinds.setdefault(f, (stamps.dtype.kind == "M", p.table.column(stamp).type))
            if split_by is not None:
                self._one_kind(split_by, kinds)
            out[name] = self._join("files" if name == "all" else name, parts, scored)
            if not labeled:
                self.row_counts[name]["labels"] = False
        if "all" in out:
            out = {**self._apply_rule(out.pop("all")), **out}  # and the files to score, if any
        for name, d in out.items():
            counts = self.row_counts.setdefault(name, {})
            counts["rows"] = len(d.labels)
            counts["filled"] = {
                c.column: int(np.isnan(d.dense[:, i]).sum())
                for i, c in enumerate(self.schema.dense)
                if c.column in self.fill
            }
        self._decoded = out
        return out

    def _one_kind(self, column: str, kinds: dict[str, tuple[bool, Any]]) -> None:
        """The split column holds numbers in every file, or times in every file (then its time zone is kept)."""
        (first, (times, kind)), *rest = kinds.items()
        for f, (t, k) in rest:
            if t != times:
                raise DataError(
                    f"{f}: column {column!r} is {k}, but in {first} it is {kind}: the split rule's column must hold "
                    "numbers in every file, or dates/times in every file."
                )
        tz = getattr(kind, "tz", None)
        self._stamp_tz = str(tz) if times and tz else None

    def _join(self, name: str, parts: Sequence[Decoded], scored: bool = False) -> Decoded:
        """The parts of one source as one, bad rows dropped; ``scored``: with the rows' keys (the schema's key
        columns, or without any, ``row``: the row's place in the source's files, 0-based, dropped rows counted)."""
        keep = np.concatenate([p.keep for p in parts])
        self.dropped_rows += int((~keep).sum())
        self.row_counts[name] = {"read": len(keep), "dropped": int((~keep).sum())}
        if not keep.any():
            raise DataError(
                f"TabularDataModule: {name}: every one of the {len(keep)} rows was dropped (bad_rows: drop). HINT: "
                "set `bad_rows: error` to see the first bad row."
            )
        sparse = {}
        for c in self.schema.sparse:
            ids, lengths, weights = concat_jagged([p.sparse[c.feature] for p in parts])
            values_kept = rows_of(lengths, keep)
            sparse[c.feature] = (ids[values_kept], lengths[keep], None if weights is None else weights[values_kept])
        stamps = None if parts[0].timestamps is None else np.concatenate([p.timestamps for p in parts])[keep]
        keys = None
        if scored:
            import pyarrow as pa

            keys = (
                pa.concat_tables([p.keys for p in parts]).filter(pa.array(keep))
                if self.schema.keys
                else pa.table({"row": np.flatnonzero(keep)})
            )
        return Decoded(
            np.concatenate([p.labels for p in parts])[keep],
            np.concatenate([p.dense for p in parts])[keep],
            sparse,
            stamps,
            np.ones(int(keep.sum()), dtype=bool),
            keys,
        )

    def _apply_rule(self, data: Decoded) -> dict[str, Decoded]:
        assert self.split_rule is not None
        which = split_rows(self.split_rule, len(data.labels), data.timestamps, self._stamp_tz)
        return {name: take(data, which == i) for i, name in enumerate(_SPLITS) if (which == i).any()}

    # ---- learning from the training split ----------------------------------------------------------------------
    def _learn(self) -> None:
        """Vocabularies (one per table: features sharing a table share its ids) and dense statistics, from files or
        the training split, unless already known."""
        needed: dict[str, list[SparseColumn]] = {}
        for c in self.schema.sparse:
            key = c.table or c.feature
            if c.ids == "vocab" and key not in self.vocabularies:
                needed.setdefault(key, []).append(c)
        for key, group in list(needed.items()):
            files = [c.vocab_file for c in group if c.vocab_file]
            if files:
                self.vocabularies[key] = Vocabulary.read(files[0])
                del needed[key]
        stats = [c for c in self.schema.dense if c.transform == "standardize" and c.column not in self.dense_stats]
        stats = [c for c in stats if c.mean is None or c.std is None]
        means = [c for c, v in self.fill.items() if v == "mean" and c not in self.fill_means]
        if not needed and not stats and not means:
            return
        counts: dict[str, dict[str, int]] = {key: {} for key in needed}
        moments = np.zeros((len(stats), 3))  # values, sum, sum of squares per standardized column
        present = np.zeros((len(means), 2))  # values, sum per column filled with its mean
        dense = [c.column for c in self.schema.dense]
        for train in self._train_parts():
            for key, group in needed.items():
                raw = np.concatenate([id_text(train.sparse[c.feature][0]) for c in group])  # 42 and "42": one value
                values, n = np.unique(raw, return_counts=True)
                seen = counts[key]
                for v, k in zip(values.tolist(), n.tolist()):
                    seen[v] = seen.get(v, 0) + k
            for i, d in enumerate(stats):
                column = train.dense[train.keep, self.schema.dense.index(d)]
                column = column[~np.isnan(column)]  # the values present: missing ones are filled after
                moments[i] += (len(column), column.sum(), np.square(column).sum())
            for i, name in enumerate(means):
                column = train.dense[train.keep, dense.index(name)]
                column = column[~np.isnan(column)]
                present[i] += (len(column), column.sum())
        for key, group in needed.items():
            self.vocabularies[key] = Vocabulary.build(counts[key], max(c.min_count for c in group))
        for (n, total, squares), d in zip(moments, stats):
            mean = total / max(n, 1)
            self.dense_stats[d.column] = (float(mean), float(np.sqrt(max(squares / max(n, 1) - mean**2, 0.0))))
        for (n, total), name in zip(present, means):
            if n == 0:
                raise ValueError(
                    f"TabularDataModule: fill: mean for {name!r}: every {name!r} of the training split is missing, "
                    f"there is no mean to fill with. HINT: a constant, e.g. `fill: {{{name}: 0.0}}`."
                )
            self.fill_means[name] = float(total / n)
        self._write_state()

    def _fills(self) -> dict[str, float]:
        """The value each filled dense column's missing values take (the means once learned)."""
        return {
            c: float(v) if v != "mean" else self.fill_means[c]
            for c, v in self.fill.items()
            if v != "mean" or c in self.fill_means
        }

    def _write_state(self) -> None:
        if not self.state_dir:
            return
        import json

        os.makedirs(self.state_dir, exist_ok=True)
        for table, vocab in self.vocabularies.items():
            vocab.write(os.path.join(self.state_dir, f"vocab_{table}.txt"))
        with open(os.path.join(self.state_dir, "dense_stats.json"), "w") as f:
            json.dump({k: {"mean": m, "std": s} for k, (m, s) in self.dense_stats.items()}, f, indent=2)
        if self.fill_means:
            with open(os.path.join(self.state_dir, "fill_means.json"), "w") as f:
                json.dump(self.fill_means, f, indent=2)

    def state_dict(self) -> dict[str, Any]:
        """The vocabularies, dense statistics and fill means (Lightning saves them in every checkpoint), with the
        schema and ``fill`` they apply to, so that a checkpoint alone tells how a raw row becomes the model's input
        (``lightning_rec.serving`` records it in the serving artifact; :meth:`load_state_dict` reads neither back:
        the DataModule's own arguments stay authoritative)."""
        return {
            "vocabularies": {f: v.values for f, v in self.vocabularies.items()},
            "dense_stats": {k: list(v) for k, v in self.dense_stats.items()},
            "fill_means": dict(self.fill_means),
            "schema": asdict(self.schema),
            "fill": dict(self.fill),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, so ids map as when training.

        Lightning restores a checkpoint after ``setup()`` built the splits: the in-memory splits are built again (on
        their next use) only if the checkpoint's vocabularies or statistics differ from those they were built with.
        """
        before = self.state_dict()
        self.vocabularies = {f: Vocabulary(v) for f, v in state.get("vocabularies", {}).items()}
        self.dense_stats = {k: (float(v[0]), float(v[1])) for k, v in state.get("dense_stats", {}).items()}
        self.fill_means = {k: float(v) for k, v in state.get("fill_means", {}).items()}
        if self.state_dict() != before:
            self._splits = {}

    # ---- splits ---------------------------------------------------------------------------------------------
    def _train_parts(self) -> Iterator[Decoded]:
        """The training split's rows for learning vocabularies and statistics: whole (in memory), or (streaming) one
        unit at a time, never all at once; the streaming pass also checks every training row before training."""
        if not self.stream:
            yield self._read()["train"]
            return
        drop = self.bad_rows == "drop"
        counts: dict[str, Any] = {"read": 0, "dropped": 0, "rows": 0, "filled": dict.fromkeys(self.fill, 0)}
        kept_rows: dict[int, np.ndarray] = {}
        for k, unit in enumerate(self._units("train")):
            table = read_unit(unit, self._columns(), self.csv_columns, self.csv_delimiter, self.csv_null_values)
            decoded = decode(Part(table, unit.file, where(unit), unit.first_line), self.schema, drop, None, self.fill)
            if not decoded.keep.all():
                kept_rows[k] = decoded.keep
            dropped = int((~decoded.keep).sum())
            self.dropped_rows += dropped
            kept = take(decoded, decoded.keep)
            counts["read"] += len(decoded.keep)
            counts["dropped"] += dropped
            counts["rows"] += len(kept.labels)
            for i, c in enumerate(self.schema.dense):
                if c.column in self.fill:
                    counts["filled"][c.column] += int(np.isnan(kept.dense[:, i]).sum())
            yield kept
        self.row_counts["train"] = counts
        if drop:
            self._kept_rows["train"] = kept_rows  # the stream reads these rows only (no second pass)

    def _kept(self, split: str) -> dict[int, np.ndarray]:
        """Streaming with ``bad_rows: drop``: per unit of ``split`` (its index) that has bad rows, which of its rows
        are kept; from the training pass, or one pass over the split's files (every rank finds the same rows, so the
        ranks cut the same kept rows into the same number of batches)."""
        if self.bad_rows != "drop":
            return {}
        if split not in self._kept_rows:
            kept_rows: dict[int, np.ndarray] = {}
            read = dropped = 0
            filled = dict.fromkeys(self.fill, 0)
            for k, unit in enumerate(self._units(split)):
                columns = self._columns(stamp=split == "train")  # what the stream's reader reads
                table = read_unit(unit, columns, self.csv_columns, self.csv_delimiter, self.csv_null_values)
                part = Part(table, unit.file, where(unit), unit.first_line)
                decoded = decode(part, self.schema, True, None, self.fill)
                keep = decoded.keep
                read, dropped = read + len(keep), dropped + int((~keep).sum())
                for i, c in enumerate(self.schema.dense):
                    if c.column in self.fill:
                        filled[c.column] += int(np.isnan(decoded.dense[keep, i]).sum())
                if not keep.all():
                    kept_rows[k] = keep
            if read == dropped:  # as in memory
                raise DataError(
                    f"TabularDataModule: {split}: every one of the {read} rows was dropped (bad_rows: drop). HINT: "
                    "set `bad_rows: error` to see the first bad row."
                )
            if split not in self.row_counts:  # counted and logged as in memory (once: a later pass reuses these)
                self.row_counts[split] = {"read": read, "dropped": dropped, "rows": read - dropped, "filled": filled}
                self.dropped_rows += dropped
                self._report(split)
            self._kept_rows[split] = kept_rows
        return self._kept_rows[split]

    def _units(self, split: str) -> list[Unit]:
        if split not in self._unit_lists:
            patterns = self.sources.get(split)
            if patterns is None:
                raise ValueError(f"TabularDataModule: no files for the {split!r} split.")
            files = expand(patterns, split)
            for f in files:
                not_empty(f)
            units = list_units(files, self.chunk_bytes, header=not self.csv_columns)
            rows = {f: 0 for f in files}
            for u in units:
                rows[u.file] += u.rows
            for f, n in rows.items():
                if n == 0:
                    header = f.endswith(_PARQUET_SUFFIXES) or self.csv_columns
                    raise DataError(f"{f}: no rows{'' if header else ': line 1 is the header and no line follows it'}.")
            self._unit_lists[split] = units
        return self._unit_lists[split]

    def setup(self, stage: str) -> None:
        if self._splits:
            return
        self.check()
        if self.stream:
            return  # the loaders read the files
        self._build()

    def _build(self) -> None:
        """The in-memory splits, their ids mapped by the current vocabularies and statistics."""
        self._learn()
        decoded = self._read()
        mapper = self._mapper()
        self._splits = {name: mapper.dataset(d) for name, d in decoded.items()}
        if "test" not in self._splits and "val" in self._splits:
            self._splits["test"] = self._splits["val"]

    def _mapper(self) -> Mapper:
        return Mapper(self.schema, dict(self.vocabularies), dict(self.dense_stats), self._fills())

    def predict_keys(self) -> Any:
        """The keys of the rows ``predict`` scores, one per row of its split in order (a ``pyarrow.Table``): the
        schema's ``keys`` columns as the files hold them, or without keys ``row``, the row's 0-based place in the
        files scored (rows dropped by ``bad_rows: drop`` counted, so it still points into the files).
        :class:`~lightning_rec.callbacks.ScoreWriter` writes them beside the scores.

        Raises:
            ValueError: streaming (``stream: true``): the rows to score are not held in memory.

        Example::

            dm = TabularDataModule(schema={..., "keys": ["user_id", "item_id"]}, train=..., predict_files="pairs.csv")
            dm.predict_keys().column_names   # ['user_id', 'item_id']
        """
        if self.stream:
            raise ValueError(
                "TabularDataModule(stream=True) does not keep the rows it scores: keys and scores are written for an "
                "in-memory DataModule. HINT: `stream: false` to score files with `predict --output`."
            )
        self.check()
        rows = self._read().get("predict" if "predict" in self.sources else "val")
        if rows is None:
            raise ValueError(
                "TabularDataModule: there are no rows to score: give `predict_files` (or a validation split)."
            )
        return rows.keys

    def split(self, name: str) -> RecDataset | TableStream | None:
        """In memory: the rows of split ``name`` (after :meth:`setup`); streaming: a :class:`TableStream` of this
        rank's batches of its files. ``predict`` runs over ``predict_files``, else the validation rows (and,
        streaming, ``test`` too when there are no test files)."""
        self.check()
        if self.stream:
            return self._stream(name)
        name = "val" if name == "predict" and "predict" not in self.sources else name
        if not self._splits:
            self._build()  # a checkpoint restored after setup() brought other vocabularies or statistics
        if name not in self._splits:
            raise ValueError(f"TabularDataModule: there is no {name!r} split (splits: {sorted(self._splits)}).")
        if name == "train" and self._time is not None:  # replayed in time order: the stream's batching, in memory
            rank, world_size = self.rank_and_world_size
            rows = self._splits[name]
            return TableStream(
                [Unit("<memory: train>", len(rows))],
                _Slice(rows),
                self.batch_size,
                rank=rank,
                world_size=world_size,
                window=self.window,
                time=self._time,
            )
        return self._splits[name]

    def _stream(self, name: str) -> TableStream | None:
        split = "val" if name == "predict" and "predict" not in self.sources else name
        if split == "test" and self.sources.get("test") is None:
            split = "val"
        if split != "train" and self.sources.get(split) is None:
            return None  # no such files (e.g. a stream trained without validation): no batches
        rank, world_size = self.rank_and_world_size
        time = self._time if split == "train" else None
        units = list(self._units(split))
        # bad_rows: drop: a unit with bad rows counts its kept rows, which its reader reads (the time order keeps its
        # own, indexing raw rows), so the batches are cut from the rows the in-memory DataModule keeps
        kept = {} if time is not None else self._kept(split)
        masks = {}
        for k, mask in kept.items():
            units[k] = replace(units[k], rows=int(mask.sum()))
            masks[units[k]] = mask
        units = [u for u in units if u.rows]  # a unit whose every row is dropped is not read at all
        reader = UnitReader(
            self._mapper(),
            self._columns(stamp=split == "train"),
            self.csv_columns,
            self.csv_delimiter,
            self.bad_rows,
            self.csv_null_values,
            kept=masks,
        )
        return TableStream(
            units,
            reader,
            self.batch_size,
            rank=rank,
            world_size=world_size,
            shuffle=split == "train",
            seed=self.seed,
            window=self.window,
            time=time,
        )


class _Slice:
    """Rows ``[a, b)`` of an in-memory split (a time-ordered :class:`TableStream`'s read)."""

    def __init__(self, rows: RecDataset) -> None:
        self.rows = rows

    def __call__(self, unit: Unit, a: int, b: int) -> RecDataset:
        return self.rows.subset(torch.arange(a, b))
