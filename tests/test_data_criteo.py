"""Criteo format: parsing, hashing, TSV vs TorchRec's .npy, rank/worker partitions, streaming, errors."""

from __future__ import annotations

import gzip
import math
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_rec.data import CriteoDataModule, write_criteo_tsv
from lightning_rec.data.criteo import CriteoNpyDataset, CriteoTSVStream, parse_lines


def _labels(batches) -> List[float]:
    return [x for b in batches for x in b.labels.tolist()]


def _row_keys(batches) -> List[tuple]:
    """Identify rows by (label, dense, ids): unique enough in random data."""
    out = []
    for b in batches:
        ids = torch.stack([b.sparse_features[f"cat_{i}"].values() for i in range(26)], 1)
        out += [tuple(r) for r in torch.cat([b.labels[:, None], b.dense_features, ids.float()], 1).tolist()]
    return out


def test_parse_exact_values() -> None:
    ints = ["3", "", "-2"] + ["0"] * 10
    cats = ["ff", "", "10"] + ["1"] * 23
    with_label = "1\t" + "\t".join(ints + cats)
    without_label = "\t".join(ints + cats)
    b = parse_lines([("f", 1, with_label), ("f", 2, without_label)], torch.full((26,), 100))
    assert b.labels.tolist() == [1.0, 0.0]
    assert b.dense_features[0, :3].tolist() == pytest.approx([math.log(4), 0.0, 0.0])  # empty -> 0, negative -> 0
    assert b.sparse_features["cat_0"].values().tolist() == [255 % 100] * 2
    assert b.sparse_features["cat_1"].values().tolist() == [0, 0]  # empty categorical -> id 0
    assert b.sparse_features["cat_2"].values().tolist() == [16, 16]
    per_table = parse_lines([("f", 1, with_label)], torch.tensor([7] + [100] * 25))
    assert per_table.sparse_features["cat_0"].values().tolist() == [255 % 7]


def test_errors_name_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    write_criteo_tsv(bad, 5)
    bad.write_text(bad.read_text() + "1\t2\t3\n")
    with pytest.raises(ValueError, match=r"bad\.txt:6: expected 40 .* got 3"):
        list(CriteoTSVStream([str(bad)], batch_size=100))
    dm = CriteoDataModule(train=[str(tmp_path / "nope.txt")])
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        dm.train_dataloader()
    with pytest.raises(ValueError, match="list of 26"):
        CriteoDataModule(num_embeddings=[10, 20])


def _tsv_to_npys(tsv: Path, prefix: Path) -> None:
    """What torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys writes (it needs the optional iopath)."""
    rows = [line.rstrip("\n").split("\t") for line in tsv.read_text().splitlines()]
    dense = np.array([[int(v or 0) for v in r[1:14]] for r in rows], dtype=np.int32)
    dense -= dense.min() - 2
    np.save(f"{prefix}_dense.npy", np.log(dense, dtype=np.float32))
    np.save(f"{prefix}_sparse.npy", np.array([[int(v or "0", 16) for v in r[14:]] for r in rows], dtype=np.int64))
    np.save(f"{prefix}_labels.npy", np.array([int(r[0]) for r in rows], dtype=np.int32).reshape(-1, 1))


def test_tsv_and_npy_layouts_agree(tmp_path: Path) -> None:
    tsv = tmp_path / "day_0"
    write_criteo_tsv(tsv, 300, seed=2)
    prefix = tmp_path / "npy" / "day_0"
    prefix.parent.mkdir()
    _tsv_to_npys(tsv, prefix)
    stream = list(CriteoTSVStream([str(tsv)], batch_size=300, num_embeddings=1000))
    npy = CriteoNpyDataset([str(prefix)], num_embeddings=1000)[torch.arange(300)]
    assert torch.equal(stream[0].labels, npy.labels)
    assert torch.equal(stream[0].sparse_features.values(), npy.sparse_features.values())
    # Dense: TorchRec stores log(x - file_min + 2), which a stream cannot compute (the minimum is unknown
    # until the end); ours is log(max(x, 0) + 1). Both are the same increasing function of x >= 0 up to a shift.
    theirs = np.exp(np.load(f"{prefix}_dense.npy").astype(np.float64))  # x - min + 2
    ours = np.expm1(stream[0].dense_features.numpy().astype(np.float64))  # max(x, 0)
    nonneg = ours > 0
    shift = theirs[nonneg] - ours[nonneg]
    assert np.allclose(shift, shift[0], atol=1e-2)
    # The DataModule detects the .npy layout from the prefix and covers every row (shuffled) once.
    batches = list(CriteoDataModule(train=[str(prefix)], num_embeddings=1000, batch_size=64).train_dataloader())
    assert sorted(_row_keys(batches)) == sorted(_row_keys([npy]))


@pytest.mark.parametrize("world_size,rows,batch", [(2, 1000, 64), (3, 1001, 50), (2, 129, 64), (3, 2, 10)])
def test_ranks_get_equal_batch_counts_and_each_row_once(tmp_path: Path, world_size: int, rows: int, batch: int) -> None:
    path = tmp_path / "t.txt"
    write_criteo_tsv(path, rows, seed=rows)
    everything = _row_keys(CriteoTSVStream([str(path)], batch_size=rows))
    per_rank = [list(CriteoTSVStream([str(path)], batch, 100_000, rank=r, world_size=world_size)) for r in range(world_size)]
    assert len({len(b) for b in per_rank}) == 1, "every rank must run the same number of batches"
    got = sorted(k for bs in per_rank for k in _row_keys(bs))
    tail = rows % (world_size * batch)
    kept = rows - tail if tail < world_size else rows  # a last round with fewer rows than ranks is dropped
    assert got == sorted(everything[:kept])
    assert all(b.labels.numel() <= batch for bs in per_rank for b in bs)


def test_workers_do_not_duplicate_rows(tmp_path: Path) -> None:
    path = tmp_path / "t.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write(write_criteo_tsv(tmp_path / "plain.txt", 700, seed=5).read_text())
    single = _row_keys(CriteoTSVStream([str(path)], 50))
    loader = DataLoader(CriteoTSVStream([str(path)], 50), batch_size=None, num_workers=2, multiprocessing_context="spawn")
    assert sorted(_row_keys(loader)) == sorted(single) and len(single) == 700


def test_streaming_reads_only_a_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.txt"
    write_criteo_tsv(path, 20_000, seed=1)
    lines_read = []
    import lightning_rec.data.criteo as criteo

    real_open = criteo._open

    def counting_open(p: str):
        f = real_open(p)

        def lines():
            for line in f:
                lines_read.append(1)
                yield line

        return _Wrapped(f, lines())

    monkeypatch.setattr(criteo, "_open", counting_open)
    first = next(iter(CriteoTSVStream([str(path)], batch_size=100, world_size=2)))
    assert first.labels.numel() == 100
    assert len(lines_read) <= 200, f"read {len(lines_read)} of 20000 lines to produce one batch"


class _Wrapped:
    def __init__(self, f, it):
        self.f, self.it = f, it

    def __enter__(self):
        return self.it

    def __exit__(self, *a):
        self.f.close()


def test_datamodule_npy_and_tsv_features(tmp_path: Path) -> None:
    dm = CriteoDataModule(train=[str(write_criteo_tsv(tmp_path / "a.txt", 10))], num_embeddings=list(range(1, 27)))
    assert [f.num_embeddings for f in dm.sparse_features] == list(range(1, 27))
    assert dm.num_dense_features == 13
    batches = list(dm.train_dataloader())
    assert sum(b.labels.numel() for b in batches) == 10
