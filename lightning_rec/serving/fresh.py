"""Serve what a trainer publishes: :class:`FreshModel` follows a publish directory (:mod:`lightning_rec.serving.deltas`)
and answers requests with its newest complete version, picking up new versions while it serves.

It starts from the newest full package ``f <= LATEST`` (loaded by :func:`~lightning_rec.serving.load_pt2`: versions,
CPU and content checked) and applies the deltas ``f+1 .. LATEST`` in order; :meth:`FreshModel.refresh` (or a
background poll) applies those published after. A delta is read and checked whole (its manifest, each file's size
and SHA-256, the tables and weights it names against the package) before anything changes; one that is missing or
damaged is refused by name (a logged warning and :attr:`FreshModel.refused`) and the server keeps its last good
version.

How an update reaches the compiled package: the package records where each table's rows lie in its constants and
which training tensor each other constant is (``InferenceSpec.table_layout``, ``constant_sources``: see
:mod:`lightning_rec.serving.layout`). The server keeps its own copy of each table constant that a delta changes, two
in fact (double buffering): it writes a delta's rows into the copy no request reads (a cost in proportion to the
rows, plus the rows of the previous update, which that copy lacks), then re-points the package at it
(``load_constants(..., user_managed=True)``, no copy) while no request runs: a readers-writer lock lets requests run
together and an update wait for those in flight. A request is answered wholly by the old version or wholly by the
new one. The dense weights are replaced by the delta's own tensors the same way.

Memory: each table constant is held three times, the package's own copy (torch's Python loader cannot free it) and
the server's two, made when the full package is loaded (so that the first update costs no more than the next).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_rec.errors import ServingError
from lightning_rec.serving.artifact import InferenceSpec
from lightning_rec.serving.deltas import (
    Delta,
    DeltaError,
    full_manifest_path,
    full_path,
    read_delta,
    read_latest,
    read_manifest,
)
from lightning_rec.serving.layout import read_table_bytes
from lightning_rec.serving.pt2 import Pt2Model, load_pt2

__all__ = ["FreshModel", "follow"]

log = logging.getLogger(__name__)


class _ReadWriteLock:
    """Many readers (requests) or one writer (a re-point); a waiting writer lets no new reader in."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._waiting = 0

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._writing or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def writing(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            while self._writing or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


# A table's rows in a delta: (byte offset of the table's row 0 in its constant, the table's rows, ids, their bytes)
_Rows = tuple[int, int, Tensor, Tensor]


class _Table:
    """A table constant the server holds itself: two copies, one read by requests (``active``), and the rows
    written to the active one since the other was last written (``pending``)."""

    def __init__(self, initial: Tensor) -> None:
        self.copies = [initial, None]
        self.active = 0
        self.pending: list[_Rows] = []

    def inactive(self) -> Tensor:
        spare = self.copies[1 - self.active]
        if spare is None:  # a copy of the table, once
            spare = self.copies[1 - self.active] = self.copies[self.active].clone()  # type: ignore[union-attr]
            self.pending = []
        return spare


class FreshModel:
    """A model that serves the newest complete version of a publish directory, called like
    :class:`~lightning_rec.serving.Pt2Model`: ``model([dense_features,] values, lengths[, weights])``.

    Args:
        root: the publish directory (``LATEST``, ``versions/``, ``full/``; see :mod:`lightning_rec.serving.deltas`).
        check_inputs: name the problem of a refused request in Python (see :func:`~lightning_rec.serving.load_pt2`).
        verify: check the full package's records (SHA-256) before loading it; the deltas are always checked.
        poll_seconds: also look for new versions every so many seconds in a background thread (``None``: only
            when :meth:`refresh` is called); :meth:`close` stops it.

    Attributes:
        version: the version it serves.
        step: the training step of that version.
        refused: ``(version, message)`` of the last version it refused (missing or damaged), ``None`` if none.

    Raises:
        ServingError: nothing published yet, no full package at or before ``LATEST``, or a package that records no
            table layout (exported before lightning_rec recorded one: export it again).

    Example::

        model = FreshModel("publish/")                 # the newest full package, then its deltas
        probabilities = model(dense, values, lengths)
        model.refresh()                                # apply what was published since; returns the version
        model.version, model.step
    """

    def __init__(
        self, root: str | Path, *, check_inputs: bool = True, verify: bool = True, poll_seconds: float | None = None
    ) -> None:
        self.root = Path(root)
        self.refused: tuple[int, str] | None = None
        self._lock = _ReadWriteLock()
        self._updating = threading.Lock()  # one update at a time (refresh from a poll and from the caller)
        self._check_inputs, self._verify = check_inputs, verify
        latest = read_latest(self.root)
        if latest is None:
            raise ServingError(f"{str(self.root)!r}: nothing is published yet (no {self.root / 'LATEST'})")
        full = self._newest_full(latest)
        if full is None:
            raise ServingError(
                f"{str(self.root)!r}: no full package at or before version {latest} (full/vNNNNNN.pt2 with its .json)"
            )
        self._load_full(full)
        self.refresh()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if poll_seconds is not None:
            self._poller = threading.Thread(target=self._poll, args=(poll_seconds,), daemon=True, name="FreshModel")
            self._poller.start()

    @property
    def spec(self) -> InferenceSpec:
        """The served package's :class:`~lightning_rec.serving.InferenceSpec`."""
        return self._model.spec

    def __call__(self, *args: Tensor | None) -> Tensor:
        with self._lock.reading():
            return self._model(*args)

    def refresh(self) -> int:
        """Apply every version published after the served one, in order, up to ``LATEST``; returns the version served.
        A missing or damaged version is refused (a warning and :attr:`refused`) and the server stays on the last
        good one; it is tried again at the next refresh."""
        with self._updating:
            latest = read_latest(self.root)
            while latest is not None and self.version < latest:
                version = self.version + 1
                try:
                    self._apply(read_delta(self.root, version))
                    continue
                except DeltaError as err:
                    self._refuse(version, err)
                # a full package at or after the refused version (retention may have deleted the deltas a server
                # that fell behind needs) takes the server past it
                full = self._newest_full(latest, after=self.version)
                if full is None:
                    break
                try:
                    self._load_full(full)
                except (ServingError, OSError) as err:
                    self._refuse(full, err)
                    break
            return self.version

    def _refuse(self, version: int, err: Exception) -> None:
        self.refused = (version, str(err))
        log.warning("FreshModel: not serving version %d, staying on version %d: %s", version, self.version, err)

    def close(self) -> None:
        """Stop the background poll (if any)."""
        if self._poller is not None:
            self._stop.set()
            self._poller.join()
            self._poller = None

    def __enter__(self) -> FreshModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- loading -------------------------------------------------------------------------------------------------

    def _newest_full(self, latest: int, after: int = 0) -> int | None:
        """The newest full package ``after < f <= latest`` that has its manifest (written after the package)."""
        versions = sorted(
            (int(p.stem[1:]) for p in (self.root / "full").glob("v*.pt2") if p.stem[1:].isdigit()), reverse=True
        )
        for version in versions:
            if after < version <= latest and full_manifest_path(self.root, version).is_file():
                return version
        return None

    def _load_full(self, version: int) -> None:
        """Load the full package at ``version`` and serve it (from the next request on)."""
        path = full_path(self.root, version)
        manifest = read_manifest(full_manifest_path(self.root, version))
        entry = manifest.files.get(path.name)
        if manifest.kind != "full" or manifest.version != version or entry is None:
            raise DeltaError(f"{str(path)!r}: its manifest is not a full package's at version {version}")
        if not path.is_file():
            raise DeltaError(f"version {version}: {str(path)!r} is missing")
        if path.stat().st_size != entry["bytes"]:
            raise DeltaError(f"{str(path)!r}: {path.stat().st_size} bytes; its manifest records {entry['bytes']}")
        model = load_pt2(path, check_inputs=self._check_inputs, verify=self._verify)
        spec = model.spec
        if not spec.table_layout and spec.tables or spec.constant_sources is None:
            raise ServingError(
                f"{str(path)!r} records no table layout (exported before lightning_rec recorded one), so no delta can "
                "update it. HINT: export it again with this lightning_rec."
            )
        if spec.fixed_sources:
            raise ServingError(
                f"{str(path)!r} reads the trained tensor(s) {spec.fixed_sources} as anonymous constants (a tensor held "
                "in a plain dict: TorchRec's position weights), which no delta can update, so following deltas would "
                "serve them stale. HINT: serve its full packages (load_pt2), re-exported as they are published."
            )
        if any(entry.get("blob") is None for entry in (spec.table_layout or {}).values()):
            raise ServingError(f"{str(path)!r}: its tables' initial bytes are not in a weights blob it records.")
        model.warm_up()  # the package answers its recorded request as at export (before any delta changes it)
        # The server's two copies of each table constant, made now (a cost in proportion to the tables, paid at load
        # rather than by the first version published after it)
        tables = {}
        for entry in (spec.table_layout or {}).values():
            if entry["constant"] not in tables:
                tables[entry["constant"]] = _Table(read_table_bytes(path, entry))
                tables[entry["constant"]].inactive()
        with self._lock.writing():
            self._model: Pt2Model = model
            self._package = path
            self._tables: dict[str, _Table] = tables
            self._dense_keys = {key: fqn for fqn, key in (spec.constant_sources or {}).items()}
            self._dense: dict[str, Tensor] = {}  # kept alive: the package reads them (user-managed)
            self.version, self.step = version, manifest.step

    # ---- applying a delta ----------------------------------------------------------------------------------------

    def _checked(self, delta: Delta) -> tuple[dict[str, list[_Rows]], dict[str, Tensor]]:
        """Each table constant's writes (byte offsets of the rows, rows) and each dense constant's new tensor;
        anything that does not fit the package is a DeltaError (nothing changed yet)."""
        spec, manifest = self.spec, delta.manifest
        where = f"version {manifest.version}"
        if manifest.previous != self.version:
            raise DeltaError(f"{where}: it applies on version {manifest.previous}; the server holds {self.version}")
        if manifest.table_dtype != spec.table_dtype:
            raise DeltaError(
                f"{where}: its rows are {manifest.table_dtype}; the package's tables are {spec.table_dtype}"
            )
        layout = spec.table_layout or {}
        writes: dict[str, list[_Rows]] = {}
        for table, (ids, rows) in delta.tables.items():
            entry = layout.get(table)
            if entry is None:
                raise DeltaError(f"{where}: table {table!r} is not in the package (its tables: {sorted(layout)})")
            if rows.shape[1] != entry["row_bytes"]:
                raise DeltaError(
                    f"{where}: table {table!r}: rows of {rows.shape[1]} bytes; the package's rows take {entry['row_bytes']}"
                )
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= entry["rows"]):
                raise DeltaError(f"{where}: table {table!r}: an id outside its {entry['rows']} rows")
            if ids.unique().numel() != ids.numel():
                raise DeltaError(f"{where}: table {table!r}: an id appears twice")
            writes.setdefault(entry["constant"], []).append((entry["offset"], entry["rows"], ids, rows))
        dense = {}
        for key, tensor in delta.dense.items():
            fqn = self._dense_keys.get(key)
            if fqn is None:
                continue  # a training tensor the package does not read
            dense[fqn] = tensor.contiguous()
        missing = sorted(set(self._dense_keys) - set(delta.dense))
        if missing:
            raise DeltaError(f"{where}: it lacks the dense weight(s) {missing} the package reads")
        return writes, dense

    def _apply(self, delta: Delta) -> None:
        writes, dense = self._checked(delta)
        repoint: dict[str, Tensor] = dict(dense)
        flips = []
        for constant, changes in writes.items():
            table = self._tables[constant]
            spare = table.inactive()
            for offset, count, ids, rows in [*table.pending, *changes]:  # what the spare copy lacks, then the new
                spare[offset : offset + count * rows.shape[1]].view(count, rows.shape[1]).index_copy_(0, ids, rows)
            repoint[constant] = spare
            flips.append((table, changes))
        with self._lock.writing():  # no request runs: the package reads the new version whole from the next one on
            self._model._loader.load_constants(repoint, False, False, True)
            for table, changes in flips:
                table.active, table.pending = 1 - table.active, changes
            self._dense = dense
            self.version, self.step = delta.manifest.version, delta.manifest.step

    def _poll(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            try:
                self.refresh()
            except Exception as err:  # a poll must outlive a bad directory state; refresh() logs refusals itself
                log.warning("FreshModel: polling %s failed: %s: %s", self.root, type(err).__name__, err)


def follow(root: str | Path, **kwargs: Any) -> FreshModel:
    """A :class:`FreshModel` on the publish directory ``root`` (its keyword arguments).

    Example::

        model = follow("publish/", poll_seconds=1.0)   # picks up new versions in the background
    """
    return FreshModel(root, **kwargs)
