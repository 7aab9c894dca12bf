"""Criteo-format click logs: TSV files streamed line by line, or TorchRec's ``.npy`` arrays memory-mapped.

**TSV** (Kaggle ``train.txt``/``test.txt``, the 1TB logs' ``day_0`` ... ``day_23``, plain or gzip-compressed,
recognised by content rather than by name). One line per sample, tab separated::

    label | int_0 ... int_12 | cat_0 ... cat_25
    1     | 5  ''  -2 ...    | 68fd1e64  ''  ...     (Kaggle test.txt: no label column, 39 columns)

Whether a file has labels is read from the column count of its first line (40: labelled, 39: not; every
other line must then match); unlabelled rows get label 0.

**.npy**: what ``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys`` writes (and :func:`tsv_to_npy`):
``<prefix>_dense.npy`` (N, 13), ``<prefix>_sparse.npy`` (N, 26) raw ids, ``<prefix>_labels.npy`` (N, 1).

**Features**, the same for both layouts:

- integers: an empty field is 0, a negative one is clipped to 0, then ``log(x + 1)`` (the DLRM reference
  transform, :func:`transform_dense`). A float ``_dense.npy`` is taken as already transformed; an integer one
  is transformed on reading.
- categoricals: ``id = int(hex, 16) % num_embeddings[i]`` (ids from ``.npy`` get the same modulus). An empty
  field is id 0, as in TorchRec's preprocessing, so it shares row 0 with the values that hash there.

So a TSV file and the ``.npy`` files :func:`tsv_to_npy` makes from it give identical batches. TorchRec's own
``tsv_to_npys`` stores ``log(x - m + 2)`` with ``m`` the file's smallest integer, which a stream cannot know
before its end: its sparse features and labels match the TSV exactly, its dense features by a shift of x.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import math
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES, INT_FEATURE_COUNT
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec.config import SparseFeature
from lightning_rec.data.base import RecDataModule

__all__ = [
    "CriteoDataModule",
    "CriteoNpyDataset",
    "CriteoTSVStream",
    "parse_lines",
    "transform_dense",
    "tsv_to_npy",
    "write_criteo_tsv",
]

_COLUMNS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
_NPY_PARTS = ("dense", "sparse", "labels")
_GZIP_MAGIC = b"\x1f\x8b"
_ID_MASK = (1 << 63) - 1  # Criteo ids are 32-bit; longer hex keeps its low 63 bits so it fits an int64
_Row = tuple[str, int, str, bool]  # (file, line number, text, whether the file has a label column)
_Sizes = int | Sequence[int]


def _table_sizes(num_embeddings: _Sizes) -> list[int]:
    sizes = [num_embeddings] * CAT_FEATURE_COUNT if isinstance(num_embeddings, int) else list(num_embeddings)
    if len(sizes) != CAT_FEATURE_COUNT or any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(
            f"num_embeddings must be one positive int or a list of {CAT_FEATURE_COUNT} of them (one per cat_i), "
            f"got {num_embeddings!r}. HINT: e.g. num_embeddings: 1000000."
        )
    return sizes


def transform_dense(ints: torch.Tensor) -> torch.Tensor:
    """The dense-feature transform of both layouts: negatives clipped to 0, then ``log(x + 1)``, as float32.

    Example::

        >>> transform_dense(torch.tensor([[-2, 0, 3]])).tolist()
        [[0.0, 0.0, 1.3862943649291992]]
    """
    return torch.log1p(ints.to(torch.float64).clamp(min=0)).to(torch.float32)


def _make_batch(dense: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor) -> Batch:
    """(B, 13) float dense, (B, 26) hashed ids, (B,) labels -> Batch with one id per feature and sample."""
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(DEFAULT_CAT_NAMES), values=ids.t().reshape(-1), lengths=torch.ones(ids.numel(), dtype=torch.int32)
    )
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels.to(torch.float32))


def _split_rows(rows: Sequence[_Row]) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """Lines -> (raw integers, raw (unhashed) ids, labels), with errors that name the file and line."""
    ints, cats, labels = [], [], []
    for path, lineno, text, labelled in rows:
        fields = text.rstrip("\r\n").split("\t")
        expected = _COLUMNS if labelled else _COLUMNS - 1
        if len(fields) != expected:
            raise ValueError(
                f"{path}:{lineno}: expected {expected} tab-separated columns ({'label, ' if labelled else ''}"
                f"{INT_FEATURE_COUNT} integers, {CAT_FEATURE_COUNT} hex categoricals), got {len(fields)}. HINT: fix "
                f"or remove the line (a file's first line decides whether all its lines have the label column)."
            )
        if not labelled:
            fields.insert(0, "0")
        try:
            labels.append(float(fields[0]) if fields[0] else 0.0)
            ints.append([int(v) if v else 0 for v in fields[1 : 1 + INT_FEATURE_COUNT]])
            cats.append([int(v, 16) & _ID_MASK if v else 0 for v in fields[1 + INT_FEATURE_COUNT :]])
        except ValueError as e:
            raise ValueError(
                f"{path}:{lineno}: {e}. HINT: integers must be decimal and categoricals hex; empty fields are fine."
            ) from None
    return ints, cats, labels


def _parse(rows: Sequence[_Row], sizes: torch.Tensor) -> Batch:
    ints, cats, labels = _split_rows(rows)
    dense = transform_dense(torch.tensor(ints, dtype=torch.long))
    return _make_batch(dense, torch.tensor(cats, dtype=torch.long) % sizes, torch.tensor(labels))


def parse_lines(lines: Sequence[str], num_embeddings: _Sizes = 100_000, *, has_label: bool = True) -> Batch:
    """Parse Criteo TSV lines into one :class:`~lightning_rec._batch.Batch` (errors name ``<lines>:N``).

    Example::

        >>> line = "1\\t" + "\\t".join(["5"] * 12 + ["-2"]) + "\\t" + "\\t".join(["0000000a"] * 25 + [""])
        >>> b = parse_lines([line], num_embeddings=7)
        >>> b.labels.tolist(), b.sparse_features["cat_0"].values().tolist(), b.sparse_features["cat_25"].values()
        ([1.0], [3], tensor([0]))
        >>> b.dense_features[0, -2:].tolist()   # log(5 + 1), and -2 clipped to 0
        [1.7917594909667969, 0.0]
    """
    rows = [("<lines>", i, text, has_label) for i, text in enumerate(lines, start=1)]
    return _parse(rows, torch.tensor(_table_sizes(num_embeddings)))


@contextlib.contextmanager
def _open_text(path: str) -> Iterator[io.TextIOBase]:
    """A text stream over ``path``, decompressing gzip (recognised by its magic bytes) on the fly."""
    with open(path, "rb") as raw:
        binary = gzip.GzipFile(fileobj=raw, mode="rb") if raw.peek(2)[:2] == _GZIP_MAGIC else raw
        with io.TextIOWrapper(binary, encoding="utf-8") as text:
            yield text


def _read_rows(paths: Sequence[str], has_label: bool | None) -> Iterator[_Row]:
    """Non-blank lines of the files in order; only each file's first line is looked at (for its labels)."""
    for path in paths:
        with _open_text(path) as f:
            labelled = has_label
            for lineno, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                if labelled is None:
                    columns = text.count("\t") + 1
                    if columns not in (_COLUMNS, _COLUMNS - 1):
                        raise ValueError(
                            f"{path}:{lineno}: got {columns} tab-separated columns, expected {_COLUMNS} (label, "
                            f"{INT_FEATURE_COUNT} integers, {CAT_FEATURE_COUNT} hex categoricals) or {_COLUMNS - 1} "
                            f"(no label, as in Kaggle's test.txt). HINT: is this a Criteo TSV file?"
                        )
                    labelled = columns == _COLUMNS
                yield path, lineno, text, labelled


class CriteoTSVStream(IterableDataset):
    """Streams Criteo TSV files as this rank's batches (and, in a DataLoader worker, only that worker's share).

    Every rank reads the whole stream in rounds of ``world_size * batch_size`` rows and parses only its own:
    rank ``r`` takes rows ``[r * batch_size, (r + 1) * batch_size)`` of each round. The last, partial round of
    ``n`` rows is split into ``world_size`` contiguous parts whose sizes differ by at most one (the first
    ``n % world_size`` ranks take one more); if ``n < world_size`` those rows are **dropped** (a rank with no
    rows cannot join the collective). So each row goes to one rank at most, and every rank yields the same
    number of batches, which sharded embedding lookups (collectives) need. DataLoader workers take every
    ``num_workers``-th round. No shuffling: files are read in order (Criteo days are time-ordered). At most one
    round of lines is held in memory; the cost is that every rank reads (not parses) all the input.

    Args:
        paths: TSV files (plain or gzip), read one after another.
        batch_size: rows per batch on each rank.
        num_embeddings: rows per table: one int for all 26 categoricals, or a list of 26.
        rank, world_size: this process's place among the training processes.
        has_label: ``None`` reads it from each file's column count (40 or 39).

    Example::

        >>> import os, tempfile
        >>> path = write_criteo_tsv(os.path.join(tempfile.mkdtemp(), "day_0"), 7)   # a round of 4, then 3 rows
        >>> [[b.labels.numel() for b in CriteoTSVStream([path], batch_size=2, rank=r, world_size=2)] for r in (0, 1)]
        [[2, 2], [2, 1]]
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(CriteoTSVStream([path], batch_size=2), batch_size=None)
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        batch_size: int,
        num_embeddings: _Sizes = 100_000,
        *,
        rank: int = 0,
        world_size: int = 1,
        has_label: bool | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"CriteoTSVStream: got batch_size={batch_size}, rank={rank}, world_size={world_size}; "
                f"need batch_size >= 1 and 0 <= rank < world_size."
            )
        self.paths = [str(p) for p in paths]
        self.batch_size, self.rank, self.world_size, self.has_label = batch_size, rank, world_size, has_label
        self.sizes = torch.tensor(_table_sizes(num_embeddings))
        self.start_batch = 0  # rounds the next pass skips (a resumed epoch, see lightning_rec.data.resume)

    def set_epoch(self, epoch: int) -> None:
        """Nothing to reshuffle: every epoch reads the files in order (kept for resumable loaders)."""

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        physical, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        skip = self.start_batch
        # Batch i of a rank is round i, whatever the workers; the DataLoader asks worker 0 first, so on a resumed
        # epoch worker 0 takes the round that comes next.
        worker = (physical + skip) % workers
        round_size, b, r = self.world_size * self.batch_size, self.batch_size, self.rank
        count, index, kept = 0, 0, []  # kept: the lines of the current round, if it is this worker's
        for row in _read_rows(self.paths, self.has_label):
            if index % workers == worker and index >= skip:
                kept.append(row)
            count += 1
            if count == round_size:
                if kept:
                    yield _parse(kept[r * b : (r + 1) * b], self.sizes)
                count, index, kept = 0, index + 1, []
        if count >= self.world_size and kept:  # the first count % world_size ranks take one row more
            size, extra = divmod(count, self.world_size)
            start = r * size + min(r, extra)
            yield _parse(kept[start : start + size + (r < extra)], self.sizes)


class CriteoNpyDataset:
    """Criteo ``.npy`` arrays, memory-mapped (never read whole); ``dataset[indices]`` is a whole batch.

    Use it with :func:`~lightning_rec.data.base.batch_loader` (equal batch counts on every rank). Rows come back
    in the order of ``indices``; labels below 0 (TorchRec's filler for unlabelled rows) read as 0. Pickling
    (for DataLoader workers) drops the memory maps; they are reopened on first use.

    Args:
        prefixes: one per file set, e.g. ``data/day_0`` for ``data/day_0_{dense,sparse,labels}.npy``.
        num_embeddings: rows per table; the stored raw ids are hashed by this modulus.

    Example::

        ds = CriteoNpyDataset(["data/criteo/day_0", "data/criteo/day_1"], num_embeddings=1_000_000)
        batch = ds[torch.arange(4096)]
    """

    def __init__(self, prefixes: Sequence[str | Path], num_embeddings: _Sizes = 100_000) -> None:
        self.prefixes = [str(p) for p in prefixes]
        self.sizes = torch.tensor(_table_sizes(num_embeddings))
        self._maps: list[tuple[np.ndarray, ...]] | None = None
        lengths = []
        for prefix, (dense, sparse, labels) in zip(self.prefixes, self._arrays()):
            n = dense.shape[0]
            if dense.shape != (n, INT_FEATURE_COUNT) or sparse.shape != (n, CAT_FEATURE_COUNT) or labels.size != n:
                raise ValueError(
                    f"CriteoNpyDataset: {prefix}_*.npy have shapes {dense.shape}, {sparse.shape}, {labels.shape}; "
                    f"expected ({n}, {INT_FEATURE_COUNT}), ({n}, {CAT_FEATURE_COUNT}), ({n}, 1). HINT: write them "
                    f"with tsv_to_npy or torchrec's BinaryCriteoUtils.tsv_to_npys."
                )
            lengths.append(n)
        self._starts = np.cumsum([0] + lengths)

    def _arrays(self) -> list[tuple[np.ndarray, ...]]:
        if self._maps is None:
            self._maps = [tuple(np.load(f"{p}_{k}.npy", mmap_mode="r") for k in _NPY_PARTS) for p in self.prefixes]
        return self._maps

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int | Sequence[int] | torch.Tensor) -> Batch:
        idx = torch.as_tensor(index, dtype=torch.long).reshape(-1).numpy()
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"CriteoNpyDataset: indices must be in [0, {len(self)}), got {idx.min()}..{idx.max()}.")
        part = np.searchsorted(self._starts, idx, side="right") - 1
        dense = torch.empty(idx.size, INT_FEATURE_COUNT)
        ids = torch.empty(idx.size, CAT_FEATURE_COUNT, dtype=torch.long)
        labels = torch.empty(idx.size)
        for k in np.unique(part):
            where = torch.from_numpy(np.nonzero(part == k)[0])
            # sorted, unique reads from the memory map; `inverse` restores the requested order
            local, order = np.unique(idx[where.numpy()] - self._starts[k], return_inverse=True)
            inverse = torch.from_numpy(order.reshape(-1))
            d, s, y = (torch.from_numpy(np.array(a[local])) for a in self._arrays()[k])
            d = d if d.is_floating_point() else transform_dense(d)
            dense[where], ids[where] = d.float()[inverse], s.long()[inverse] % self.sizes
            labels[where] = y.reshape(-1).float().clamp(min=0)[inverse]
        return _make_batch(dense, ids, labels)


def tsv_to_npy(paths: str | Path | Sequence[str | Path], prefix: str | Path, *, chunk_rows: int = 65536) -> int:
    """Convert Criteo TSV files into one ``<prefix>_{dense,sparse,labels}.npy`` set, streaming; returns the rows.

    The format is TorchRec's (float32 dense already transformed, int64 raw ids, int32 labels of shape (N, 1),
    -1 for unlabelled rows), with :func:`transform_dense` as the dense transform, so the arrays give the same
    batches as the TSV. Two passes over the input (count, then fill); memory stays at ``chunk_rows`` rows.

    Example::

        tsv_to_npy(["day_0.gz"], "npy/day_0")   # then CriteoDataModule(train=["npy/day_0"])
    """
    files = [str(paths)] if isinstance(paths, (str, Path)) else [str(p) for p in paths]
    n = sum(1 for _ in _read_rows(files, None))
    if n == 0:
        raise ValueError(f"tsv_to_npy: {files} hold no rows. HINT: check the paths.")
    kinds = {"dense": (np.float32, INT_FEATURE_COUNT), "sparse": (np.int64, CAT_FEATURE_COUNT), "labels": (np.int32, 1)}
    out = {k: np.lib.format.open_memmap(f"{prefix}_{k}.npy", "w+", dt, (n, w)) for k, (dt, w) in kinds.items()}
    start, rows = 0, _read_rows(files, None)
    while start < n:
        chunk = [row for _, row in zip(range(chunk_rows), rows)]
        ints, cats, labels = _split_rows(chunk)
        end = start + len(chunk)
        out["dense"][start:end] = transform_dense(torch.tensor(ints, dtype=torch.long)).numpy()
        out["sparse"][start:end] = np.array(cats, dtype=np.int64)
        out["labels"][start:end, 0] = [int(v) if row[3] else -1 for v, row in zip(labels, chunk)]
        start = end
    for a in out.values():
        a.flush()
    return n


def _resolve(patterns: Sequence[str], layout: str, split: str) -> tuple[str, list[str]]:
    """Globs -> TSV files or ``.npy`` prefixes (a matched ``*_dense.npy`` etc. counts as its prefix), and the
    layout ``"auto"`` stands for; a missing input raises FileNotFoundError naming it."""
    found: list[str] = []
    for pattern in (os.path.expanduser(str(p)) for p in patterns):
        matches = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not matches:
            raise FileNotFoundError(
                f"CriteoDataModule: the {split} pattern {pattern!r} matches no file. HINT: check the path; globs "
                f"are expanded by the DataModule, so quote them in the shell."
            )
        for m in matches:
            m = next((m[: -len(f"_{k}.npy")] for k in _NPY_PARTS if m.endswith(f"_{k}.npy")), m)
            if m not in found:
                found.append(m)
    npy = [not os.path.isfile(p) and any(os.path.isfile(f"{p}_{k}.npy") for k in _NPY_PARTS) for p in found]
    if layout == "auto":
        if any(npy) and not all(npy):
            raise ValueError(
                f"CriteoDataModule: the {split} inputs mix TSV files and .npy prefixes: {found}. HINT: use one layout."
            )
        layout = "npy" if all(npy) else "tsv"
    for p in found:
        needed = [f"{p}_{k}.npy" for k in _NPY_PARTS] if layout == "npy" else [p]
        what = f"the .npy set {p}_{{dense,sparse,labels}}.npy" if layout == "npy" else "a Criteo TSV file (or .gz)"
        for path in (n for n in needed if not os.path.isfile(n)):
            raise FileNotFoundError(
                f"CriteoDataModule: {split} input {path!r} does not exist; expected {what}. HINT: give TSV files "
                f"(train.txt, day_N), or .npy prefixes such as data/day_0 (layout 'auto' tells them apart)."
            )
    return layout, found


class CriteoDataModule(RecDataModule):
    """Criteo click logs for DLRM-style models: TSV streamed (Kaggle or 1TB layout, gzip too) or ``.npy``.

    TSV splits are :class:`CriteoTSVStream` s (read in file order; a final partial round with fewer rows than
    ranks is dropped); ``.npy`` splits are :class:`CriteoNpyDataset` s, the training one reshuffled every
    epoch from ``seed``. See the module docstring for the features.

    Args:
        train, val, test, predict: files, globs or ``.npy`` prefixes of each split. Without ``val``, ``fit`` runs
            no validation; ``predict`` defaults to ``test``.
        layout: ``"tsv"``, ``"npy"``, or ``"auto"`` (``npy`` when ``<path>_dense.npy`` etc. exist instead of
            ``<path>``).
        num_embeddings: rows per table: one int for all 26 categoricals, or a list of 26.
        batch_size, num_workers, seed: see :class:`~lightning_rec.data.base.RecDataModule`.

    Example::

        >>> dm = CriteoDataModule(train=["criteo/day_*.gz"], val=["criteo/day_23.gz"], num_embeddings=1000)
        >>> len(dm.sparse_features), dm.sparse_features[0], dm.num_dense_features
        (26, SparseFeature(name='cat_0', num_embeddings=1000, multi_hot=False, table=None), 13)
    """

    def __init__(
        self,
        train: list[str] | None = None,
        val: list[str] | None = None,
        test: list[str] | None = None,
        predict: list[str] | None = None,
        layout: Literal["auto", "tsv", "npy"] = "auto",
        num_embeddings: int | list[int] = 100_000,
        batch_size: int = 512,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        if layout not in ("auto", "tsv", "npy"):
            raise ValueError(f"CriteoDataModule: layout must be 'auto', 'tsv' or 'npy', got {layout!r}.")
        self.files = {"train": train, "val": val, "test": test, "predict": predict if predict is not None else test}
        self.layout = layout
        self.sizes = _table_sizes(num_embeddings)

    def check_files(self) -> None:
        """Name a missing input (``FileNotFoundError``) now: ``lightning-rec fit/validate/test/predict`` calls it in
        the main process, before any rank starts or table is sharded (planning, ``lightning-rec plan``, needs no
        files)."""
        for name, patterns in self.files.items():
            if patterns:
                _resolve(patterns, self.layout, name)

    @property
    def sparse_features(self) -> list[SparseFeature]:
        """``cat_0`` ... ``cat_25``, one id per sample each."""
        return [SparseFeature(name, n) for name, n in zip(DEFAULT_CAT_NAMES, self.sizes)]

    @property
    def num_dense_features(self) -> int:
        """13: the Criteo integer features."""
        return INT_FEATURE_COUNT

    def split(self, name: str) -> CriteoNpyDataset | CriteoTSVStream | None:
        """TSV: a rank-exact stream of this rank's batches; ``.npy``: the memory-mapped rows (batched for this rank
        by :meth:`~lightning_rec.data.base.RecDataModule.dataloader`); ``None`` for ``val`` without files (``fit``
        runs no validation)."""
        patterns = self.files[name]
        if not patterns:
            if name == "val":
                return None
            raise ValueError(f"CriteoDataModule: no {name} files given. HINT: set data.init_args.{name}.")
        layout, files = _resolve(patterns, self.layout, name)
        if layout == "npy":
            return CriteoNpyDataset(files, self.sizes)
        rank, world_size = self.rank_and_world_size
        return CriteoTSVStream(files, self.batch_size, self.sizes, rank=rank, world_size=world_size)


def write_criteo_tsv(path: str | Path, num_rows: int, seed: int = 0, with_label: bool = True) -> Path:
    """Write a small random file in Criteo's TSV layout; gzip-compressed when ``path`` ends in ``.gz``.

    About 10% of the integers and 5% of the categoricals are empty, some integers are negative, ids are
    32-bit hex, and the label follows ``cat_0`` (a 20-value feature), so a model can learn it.

    Example::

        >>> import os, tempfile
        >>> path = write_criteo_tsv(os.path.join(tempfile.mkdtemp(), "test.txt"), 3, with_label=False)
        >>> [line.count("\\t") + 1 for line in open(path)]
        [39, 39, 39]
    """
    rng = random.Random(seed)
    path = Path(path)
    with gzip.open(path, "wt") if path.suffix == ".gz" else open(path, "w") as f:
        for _ in range(num_rows):
            ints = ["" if rng.random() < 0.1 else str(rng.randint(-3, 2000)) for _ in range(INT_FEATURE_COUNT)]
            cats = ["" if rng.random() < 0.05 else f"{rng.getrandbits(32):08x}" for _ in range(CAT_FEATURE_COUNT)]
            cats[0] = f"{rng.randrange(20):08x}"
            p = 1 / (1 + math.exp(-(int(cats[0], 16) - 10) / 3))
            label = [str(int(rng.random() < p))] if with_label else []
            f.write("\t".join(label + ints + cats) + "\n")
    return path
