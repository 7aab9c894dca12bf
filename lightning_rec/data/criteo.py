"""Criteo-format click logs: the TSV layout (Kaggle ``train.txt``/``test.txt``, the 1TB ``day_N`` files, plain or
``.gz``), streamed line by line, and TorchRec's preprocessed ``.npy`` layout, memory-mapped.

One TSV line is ``label, int_0..int_12, cat_0..cat_25`` separated by tabs (Kaggle's test file has no label:
39 columns, read with label 0). Integers may be empty (read as 0) or negative (clamped to 0), and become
``log(x + 1)`` as in the DLRM reference. Categoricals are 32-bit hex strings; ``int(s, 16) % num_embeddings``
is the row (an empty field is 0, so it shares row 0 with values hashing there).

The ``.npy`` layout is what ``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys`` writes:
``<prefix>_dense.npy`` (float32, already log-transformed by TorchRec), ``<prefix>_sparse.npy`` (raw integer
ids, hashed here with the same modulus) and ``<prefix>_labels.npy``.
"""

from __future__ import annotations

import glob
import gzip
import math
import os
import random
from pathlib import Path
from typing import IO, Iterator, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES, INT_FEATURE_COUNT
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec.batch import Batch
from lightning_rec.data.base import RecDataModule, SparseFeature

__all__ = ["CriteoDataModule", "CriteoNpyDataset", "CriteoTSVStream", "write_criteo_tsv"]

_COLUMNS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT


def _table_sizes(num_embeddings: Union[int, Sequence[int]]) -> torch.Tensor:
    sizes = [num_embeddings] * CAT_FEATURE_COUNT if isinstance(num_embeddings, int) else list(num_embeddings)
    if len(sizes) != CAT_FEATURE_COUNT or min(sizes) < 1:
        raise ValueError(
            f"num_embeddings must be one positive int or a list of {CAT_FEATURE_COUNT} of them (one per cat_i), "
            f"got {num_embeddings!r}."
        )
    return torch.tensor(sizes, dtype=torch.long)


def _make_batch(dense: torch.Tensor, raw_ids: torch.Tensor, labels: torch.Tensor, sizes: torch.Tensor) -> Batch:
    """``raw_ids``: (B, 26) unhashed ids -> KJT with one (hashed) id per feature and sample."""
    ids = raw_ids % sizes
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(DEFAULT_CAT_NAMES), values=ids.t().reshape(-1),
        lengths=torch.ones(ids.numel(), dtype=torch.int32),
    )
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels.float())


def parse_lines(lines: Sequence[Tuple[str, int, str]], sizes: torch.Tensor) -> Batch:
    """Parse ``(file, line number, text)`` TSV lines into one :class:`~lightning_rec.batch.Batch`.

    Example::

        >>> line = "1\\t" + "\\t".join(["5"] * 13) + "\\t" + "\\t".join(["0000000a"] * 26)
        >>> b = parse_lines([("x.tsv", 1, line)], torch.full((26,), 7))
        >>> b.labels.tolist(), b.sparse_features["cat_0"].values().tolist()   # 0xa % 7
        ([1.0], [3])
    """
    labels, dense, cats = [], [], []
    for path, lineno, text in lines:
        fields = text.rstrip("\r\n").split("\t")
        if len(fields) == _COLUMNS - 1:  # Kaggle test.txt: no label
            fields = ["0", *fields]
        if len(fields) != _COLUMNS:
            raise ValueError(
                f"{path}:{lineno}: expected {_COLUMNS} tab-separated columns (label, {INT_FEATURE_COUNT} integers, "
                f"{CAT_FEATURE_COUNT} hex categoricals) or {_COLUMNS - 1} without the label, got {len(fields)}."
            )
        try:
            labels.append(float(fields[0] or 0))
            dense.append([int(f or 0) for f in fields[1 : 1 + INT_FEATURE_COUNT]])
            cats.append([int(f or "0", 16) for f in fields[1 + INT_FEATURE_COUNT :]])
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from None
    dense_t = torch.log1p(torch.tensor(dense, dtype=torch.float64).clamp(min=0)).float()
    return _make_batch(dense_t, torch.tensor(cats, dtype=torch.long), torch.tensor(labels), sizes)


def _open(path: str) -> IO[str]:
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path, "r")


class CriteoTSVStream(IterableDataset):
    """Streams Criteo TSV files, yielding this rank's batches (and only this DataLoader worker's share).

    Rows are read in rounds of ``world_size * batch_size``; rank ``r`` takes the ``r``-th slice of each round,
    so every rank yields the same number of batches (sharded lookups are collectives) and every row goes to
    one rank. The last, partial round is split evenly (sizes differ by at most one); if it has fewer rows
    than ranks, those rows are dropped. Every rank reads the whole stream but parses only its rows. No
    shuffling: the files are read in order (Criteo days are time-ordered on purpose).

    Example::

        stream = CriteoTSVStream(["day_0.gz"], batch_size=2048, num_embeddings=1_000_000, rank=0, world_size=2)
        loader = DataLoader(stream, batch_size=None)
    """

    def __init__(
        self, paths: Sequence[str], batch_size: int, num_embeddings: Union[int, Sequence[int]] = 100_000,
        rank: int = 0, world_size: int = 1,
    ) -> None:
        super().__init__()
        self.paths = list(paths)
        self.batch_size = batch_size
        self.sizes = _table_sizes(num_embeddings)
        self.rank, self.world_size = rank, world_size

    def _rounds(self) -> Iterator[List[Tuple[str, int, str]]]:
        size = self.world_size * self.batch_size
        buf: List[Tuple[str, int, str]] = []
        for path in self.paths:
            with _open(path) as f:
                for lineno, text in enumerate(f, start=1):
                    if text.strip():
                        buf.append((path, lineno, text))
                        if len(buf) == size:
                            yield buf
                            buf = []
        if len(buf) >= self.world_size:
            yield buf

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i, rows in enumerate(self._rounds()):
            if i % workers != worker:
                continue
            if len(rows) == self.world_size * self.batch_size:
                mine = rows[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
            else:
                bounds = [round(len(rows) * r / self.world_size) for r in range(self.world_size + 1)]
                mine = rows[bounds[self.rank] : bounds[self.rank + 1]]
            yield parse_lines(mine, self.sizes)


class CriteoNpyDataset:
    """TorchRec's preprocessed Criteo arrays, memory-mapped; ``dataset[indices]`` is a whole batch.

    Args:
        prefixes: one per day, e.g. ``data/criteo/day_0`` for ``day_0_{dense,sparse,labels}.npy``.
        num_embeddings: table sizes (the sparse arrays hold raw ids; they are hashed by modulus here).

    Example::

        ds = CriteoNpyDataset(["data/criteo/day_0"], num_embeddings=1_000_000)
        batch = ds[torch.arange(4096)]
    """

    def __init__(self, prefixes: Sequence[str], num_embeddings: Union[int, Sequence[int]] = 100_000) -> None:
        self.sizes = _table_sizes(num_embeddings)
        self.parts = []
        for p in prefixes:
            arrays = [np.load(f"{p}_{kind}.npy", mmap_mode="r") for kind in ("dense", "sparse", "labels")]
            self.parts.append(arrays)
        self.offsets = np.cumsum([0] + [len(a[2]) for a in self.parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: Union[torch.Tensor, Sequence[int]]) -> Batch:
        index = np.asarray(torch.as_tensor(index).reshape(-1))
        part = np.searchsorted(self.offsets, index, side="right") - 1
        dense, sparse, labels = [], [], []
        for k in np.unique(part):
            local = np.sort(index[part == k] - self.offsets[k])  # sorted reads from the memory map
            d, s, l = self.parts[k]
            dense.append(np.asarray(d[local], dtype=np.float32))
            sparse.append(np.asarray(s[local], dtype=np.int64))
            labels.append(np.asarray(l[local]).reshape(-1))
        return _make_batch(
            torch.from_numpy(np.concatenate(dense)), torch.from_numpy(np.concatenate(sparse)),
            torch.from_numpy(np.concatenate(labels).clip(min=0).astype(np.float32)), self.sizes,
        )


def _expand(paths: Sequence[str], layout: str) -> Tuple[str, List[str]]:
    """Globs -> files (or npy prefixes), and the layout ``auto`` resolves to."""
    out: List[str] = []
    for pattern in paths:
        matches = sorted(glob.glob(pattern)) or [pattern]
        out.extend(m[: -len("_dense.npy")] if m.endswith("_dense.npy") else m for m in matches)
    if layout == "auto":
        layout = "npy" if all(os.path.isfile(f"{p}_dense.npy") for p in out) else "tsv"
    for p in out:
        needed = [f"{p}_{k}.npy" for k in ("dense", "sparse", "labels")] if layout == "npy" else [p]
        missing = [n for n in needed if not os.path.isfile(n)]
        if missing:
            raise FileNotFoundError(
                f"Criteo {layout} input {missing[0]!r} does not exist. HINT: give TSV files (train.txt, day_N, "
                f"day_N.gz) or .npy prefixes (day_N for day_N_dense/sparse/labels.npy); globs are expanded."
            )
    return layout, out


class CriteoDataModule(RecDataModule):
    """Criteo click logs (TSV streamed, or TorchRec's ``.npy`` memory-mapped) for DLRM-style models.

    Args:
        train, val, test, predict: files (or globs, or ``.npy`` prefixes) of each split; a missing split has no
            loader. ``predict`` defaults to ``test``.
        layout: ``"tsv"``, ``"npy"`` or ``"auto"`` (``npy`` when ``<path>_dense.npy`` exists).
        num_embeddings: rows per table: one int for all 26 categoricals, or a list of 26.
        batch_size, num_workers, seed: see :class:`~lightning_rec.data.base.RecDataModule` (``.npy`` training
            data is reshuffled every epoch; TSV is read in order).

    Example::

        dm = CriteoDataModule(train=["criteo/day_*.gz"], val=["criteo/day_23.gz"], num_embeddings=10_000_000)
    """

    def __init__(
        self,
        train: Optional[List[str]] = None,
        val: Optional[List[str]] = None,
        test: Optional[List[str]] = None,
        predict: Optional[List[str]] = None,
        layout: Literal["auto", "tsv", "npy"] = "auto",
        num_embeddings: Union[int, List[int]] = 100_000,
        batch_size: int = 512,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.splits = {"train": train, "val": val, "test": test, "predict": predict or test}
        self.layout = layout
        self.sizes = _table_sizes(num_embeddings)

    @property
    def sparse_features(self) -> List[SparseFeature]:
        return [SparseFeature(name, int(n)) for name, n in zip(DEFAULT_CAT_NAMES, self.sizes)]

    @property
    def num_dense_features(self) -> int:
        return INT_FEATURE_COUNT

    def _dataloader(self, split: str) -> DataLoader:
        paths = self.splits[split]
        if not paths:
            raise ValueError(f"CriteoDataModule: no {split!r} files configured. HINT: set data.init_args.{split}.")
        layout, files = _expand(paths, self.layout)
        if layout == "npy":
            return self.loader(CriteoNpyDataset(files, self.sizes.tolist()), shuffle=split == "train")
        trainer = self.trainer
        rank, world_size = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        stream = CriteoTSVStream(files, self.batch_size, self.sizes.tolist(), rank=rank, world_size=world_size)
        return DataLoader(
            stream, batch_size=None, num_workers=self.num_workers,
            multiprocessing_context="spawn" if self.num_workers > 0 else None,
        )

    def train_dataloader(self) -> DataLoader:
        return self._dataloader("train")

    def val_dataloader(self) -> DataLoader:
        return self._dataloader("val")

    def test_dataloader(self) -> DataLoader:
        return self._dataloader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._dataloader("predict")


def write_criteo_tsv(path: Union[str, Path], num_rows: int, seed: int = 0, with_label: bool = True) -> Path:
    """Write a small random file in Criteo's TSV layout (empty fields, negative integers, a learnable label).

    Example::

        write_criteo_tsv("/tmp/train.txt", 1000)
    """
    rng = random.Random(seed)
    path = Path(path)
    with open(path, "w") as f:
        for _ in range(num_rows):
            ints = ["" if rng.random() < 0.1 else str(rng.randint(-3, 2000)) for _ in range(INT_FEATURE_COUNT)]
            cats = ["" if rng.random() < 0.05 else f"{rng.getrandbits(32):08x}" for _ in range(CAT_FEATURE_COUNT)]
            cats[0] = f"{rng.randrange(20):08x}"  # a small-vocabulary feature that drives the label
            p = 1 / (1 + math.exp(-(int(cats[0], 16) - 10) / 3))
            label = [str(int(rng.random() < p))] if with_label else []
            f.write("\t".join(label + ints + cats) + "\n")
    return path
