"""Criteo format: exact parsing and hashing, TSV vs .npy, rank/worker partitions, streaming, errors."""

from __future__ import annotations

import gzip
import io
import math
import pickle
import subprocess
import sys
import types
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch

import lightning_rec.data.criteo as criteo
from lightning_rec.data import CriteoDataModule, write_criteo_tsv
from lightning_rec.data.criteo import CriteoNpyDataset, CriteoTSVStream, parse_lines, transform_dense, tsv_to_npy

BIG = 1 << 40  # larger than any 32-bit id: ids stay raw, so every generated row is identified by its 26 ids


def _rows(batches: Iterable) -> list[tuple]:
    """Each sample as (label, 13 dense, 26 ids), in batch order."""
    out = []
    for b in batches:
        kjt = b.sparse_features
        assert kjt.keys() == [f"cat_{i}" for i in range(26)] and bool((kjt.lengths() == 1).all())
        ids = kjt.values().reshape(26, -1).t().double()
        out += [tuple(r) for r in torch.cat([b.labels[:, None].double(), b.dense_features.double(), ids], 1).tolist()]
    return out


def _assert_same_batch(a, b) -> None:
    assert torch.equal(a.dense_features, b.dense_features) and a.dense_features.dtype == torch.float32
    assert torch.equal(a.labels, b.labels) and a.labels.dtype == torch.float32
    assert a.sparse_features.keys() == b.sparse_features.keys()
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())


def test_parse_exact_values() -> None:
    ints = ["3", "", "-2", "0", "2000"] + ["1"] * 8
    cats = ["ff", "", "10", "FFFFFFFF", "0"] + ["abc"] * 21
    sizes = [7, 5, 100, 1000] + [10] * 22
    b = parse_lines(["1\t" + "\t".join(ints + cats), "0\t" + "\t".join(ints[::-1] + cats)], sizes)
    assert b.labels.tolist() == [1.0, 0.0]
    expected = [math.log(4), 0.0, 0.0, 0.0, math.log(2001)] + [math.log(2)] * 8  # empty -> 0, negative -> 0
    assert b.dense_features[0].tolist() == torch.tensor(expected, dtype=torch.float32).tolist()
    assert b.dense_features[1].tolist() == b.dense_features[0].flip(0).tolist()
    kjt = b.sparse_features
    assert kjt["cat_0"].values().tolist() == [255 % 7] * 2
    assert kjt["cat_1"].values().tolist() == [0, 0]  # empty categorical -> id 0
    assert kjt["cat_2"].values().tolist() == [16, 16]
    assert kjt["cat_3"].values().tolist() == [0xFFFFFFFF % 1000] * 2
    assert kjt["cat_25"].values().tolist() == [0xABC % 10] * 2
    assert kjt.stride() == 2 and kjt.values().numel() == 52
    unlabelled = parse_lines(["\t".join(ints + cats)], sizes, has_label=False)
    assert unlabelled.labels.tolist() == [0.0] and torch.equal(unlabelled.dense_features, b.dense_features[:1])
    assert torch.equal(transform_dense(torch.tensor([[-5, 0, 1]])), torch.tensor([[0.0, 0.0, math.log(2)]]))


def test_generated_file_is_realistic_and_unlabelled_files_are_detected(tmp_path: Path) -> None:
    path = write_criteo_tsv(tmp_path / "train.txt", 400, seed=3)
    lines = path.read_text().splitlines()
    fields = [line.split("\t") for line in lines]
    assert {len(f) for f in fields} == {40} and {f[0] for f in fields} == {"0", "1"}
    assert any(f[i] == "" for f in fields for i in range(1, 14))  # empty integers
    assert any(f[i] == "" for f in fields for i in range(14, 40))  # empty categoricals
    assert any(f[i].startswith("-") for f in fields for i in range(1, 14))
    # Kaggle's test.txt layout: the same rows without the label column read as label 0, features unchanged.
    test = tmp_path / "test.txt"
    test.write_text("".join("\t".join(f[1:]) + "\n" for f in fields))
    labelled, unlabelled = _rows(CriteoTSVStream([path], 128, BIG)), _rows(CriteoTSVStream([test], 128, BIG))
    assert [r[1:] for r in unlabelled] == [r[1:] for r in labelled] and {r[0] for r in unlabelled} == {0.0}
    assert {r[0] for r in labelled} == {0.0, 1.0}
    # gzip is recognised by content, whatever the name; blank lines are skipped
    gz = tmp_path / "day_0"
    gz.write_bytes(gzip.compress((path.read_text() + "\n").encode()))
    assert _rows(CriteoTSVStream([gz], 128, BIG)) == labelled


def _fake_iopath(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrec's file helpers import iopath (an optional dependency); a local-files stand-in is all they use."""
    file_io = types.ModuleType("iopath.common.file_io")
    manager = types.SimpleNamespace(
        open=lambda path, mode="r", **kw: open(path, mode), set_strict_kwargs_checking=lambda value: None
    )
    file_io.PathManagerFactory = lambda: types.SimpleNamespace(get=lambda key: manager)
    for name, module in [
        ("iopath", types.ModuleType("iopath")),
        ("iopath.common", types.ModuleType("iopath.common")),
        ("iopath.common.file_io", file_io),
    ]:
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.filterwarnings("ignore:Local function is not supported by pickle")  # inside torchrec's tsv_to_npys
def test_tsv_and_npy_give_identical_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tsv = write_criteo_tsv(tmp_path / "day_0", 300, seed=2)
    streamed = next(iter(CriteoTSVStream([tsv], batch_size=300, num_embeddings=1000)))
    assert tsv_to_npy(tsv, tmp_path / "ours_day_0", chunk_rows=64) == 300  # several chunks
    ours = CriteoNpyDataset([tmp_path / "ours_day_0"], num_embeddings=1000)
    assert len(ours) == 300
    _assert_same_batch(ours[torch.arange(300)], streamed)
    # rows come back in the requested order, duplicates included, across two file sets
    half = tmp_path / "half"
    half.write_text("".join(tsv.read_text().splitlines(keepends=True)[200:]))
    tsv_to_npy(half, tmp_path / "ours_day_1")
    two = CriteoNpyDataset([tmp_path / "ours_day_0", tmp_path / "ours_day_1"], num_embeddings=1000)
    index = [299, 5, 5, 0, 300, 399, 250]
    assert _rows([two[index]]) == [_rows([streamed])[i if i < 300 else i - 100] for i in index]
    # raw integer dense arrays are transformed on reading, with the same result
    np.save(
        tmp_path / "raw_dense.npy",
        np.array(
            [[int(v or 0) for v in line.split("\t")[1:14]] for line in tsv.read_text().splitlines()], dtype=np.int32
        ),
    )
    for part in ("sparse", "labels"):
        (tmp_path / f"raw_{part}.npy").write_bytes((tmp_path / f"ours_day_0_{part}.npy").read_bytes())
    _assert_same_batch(CriteoNpyDataset([tmp_path / "raw"], 1000)[torch.arange(300)], streamed)
    # TorchRec's own tsv_to_npys: ids and labels identical; dense is log(x - m + 2), m the file's minimum
    _fake_iopath(monkeypatch)
    from torchrec.datasets.criteo import BinaryCriteoUtils

    BinaryCriteoUtils.tsv_to_npys(str(tsv), *(str(tmp_path / f"tr_{k}.npy") for k in ("dense", "sparse", "labels")))
    theirs = CriteoNpyDataset([tmp_path / "tr"], num_embeddings=1000)[torch.arange(300)]
    assert torch.equal(theirs.sparse_features.values(), streamed.sparse_features.values())
    assert torch.equal(theirs.labels, streamed.labels)
    m = min(int(v or 0) for line in tsv.read_text().splitlines() for v in line.split("\t")[1:14])
    x = streamed.dense_features.double().expm1()  # max(x, 0)
    positive = x > 0.5
    assert m < 0 and torch.allclose(theirs.dense_features.double()[positive], (x[positive] + 2 - m).log(), atol=1e-5)


def _positions(world_size: int, rows: int, batch: int) -> list[list[list[int]]]:
    """The spec, written independently: per rank, the row positions of each of its batches."""
    out: list[list[list[int]]] = [[] for _ in range(world_size)]
    round_size = world_size * batch
    for start in range(0, rows, round_size):
        n = min(round_size, rows - start)
        if n < world_size:
            break  # too few rows to give every rank one: dropped
        sizes = [n // world_size + (r < n % world_size) for r in range(world_size)]  # all `batch` in a full round
        bounds = np.cumsum([0] + sizes) + start
        for r in range(world_size):
            out[r].append(list(range(bounds[r], bounds[r + 1])))
    return out


@pytest.mark.parametrize(
    "world_size,rows,batch",
    [(2, 1000, 64), (3, 1001, 50), (2, 129, 64), (3, 7, 2), (3, 5, 10), (3, 2, 10), (1, 130, 64)],
)
def test_each_row_goes_to_one_rank_and_batch_counts_are_equal(
    tmp_path: Path, world_size: int, rows: int, batch: int
) -> None:
    path = write_criteo_tsv(tmp_path / "t.txt", rows, seed=rows)
    everything = _rows(CriteoTSVStream([path], rows, BIG))
    assert len(set(everything)) == rows  # rows are distinguishable, so a duplicate or a loss would show
    per_rank = [list(CriteoTSVStream([path], batch, BIG, rank=r, world_size=world_size)) for r in range(world_size)]
    assert len({len(batches) for batches in per_rank}) == 1, "every rank must run the same number of batches"
    expected = _positions(world_size, rows, batch)
    for r, batches in enumerate(per_rank):
        assert [_rows([b]) for b in batches] == [[everything[i] for i in pos] for pos in expected[r]]
    got = [row for batches in per_rank for row in _rows(batches)]
    tail = rows % (world_size * batch)
    assert len(got) == len(set(got)) == rows - (tail if tail < world_size else 0)


@pytest.mark.parametrize("world_size,workers", [(1, 2), (3, 2), (2, 3)])
def test_workers_split_rounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world_size: int, workers: int) -> None:
    path = write_criteo_tsv(tmp_path / "t.txt", 523, seed=1)
    for r in range(world_size):
        monkeypatch.setattr(criteo, "get_worker_info", lambda: None)
        alone = [_rows([b]) for b in CriteoTSVStream([path], 20, BIG, rank=r, world_size=world_size)]
        per_worker = []
        for w in range(workers):
            monkeypatch.setattr(criteo, "get_worker_info", lambda w=w: types.SimpleNamespace(id=w, num_workers=workers))
            per_worker.append([_rows([b]) for b in CriteoTSVStream([path], 20, BIG, rank=r, world_size=world_size)])
        # the DataLoader takes one batch from each worker in turn: that must be the single-process sequence
        interleaved = [per_worker[i % workers][i // workers] for i in range(len(alone))]
        assert interleaved == alone and sum(map(len, per_worker)) == len(alone)


@pytest.mark.dist
def test_datamodule_with_two_workers_never_forked_from_the_training_process(tmp_path: Path) -> None:
    path = tmp_path / "day_0.gz"
    write_criteo_tsv(path, 700, seed=5)
    single = _rows(CriteoDataModule(train=[str(path)], batch_size=50, num_embeddings=BIG).train_dataloader())
    loader = CriteoDataModule(train=[str(path)], batch_size=50, num_embeddings=BIG, num_workers=2).train_dataloader()
    # forked from the package's fork server (or spawned), never from this process (its gloo threads)
    assert loader.num_workers == 2 and loader.multiprocessing_context.get_start_method() in ("forkserver", "spawn")
    assert _rows(loader) == single and len(set(single)) == 700


@pytest.mark.dist
def test_workers_start_for_a_script_read_from_standard_input(tmp_path: Path) -> None:
    """``python - < script.py``: a worker process runs ``__main__`` again from ``__main__.__file__``, here
    ``"<stdin>"``, which it cannot open; the loader's workers start all the same and read what no workers read."""
    path = tmp_path / "day_0.tsv"
    write_criteo_tsv(path, 300, seed=3)
    script = f"""
from lightning_rec.data import CriteoDataModule

def rows(workers):
    dm = CriteoDataModule(train=[{str(path)!r}], batch_size=50, num_embeddings=1000, num_workers=workers)
    return [b.sparse_features.values().tolist() for b in dm.train_dataloader()]

print(rows(2) == rows(0), len(rows(0)))
"""
    out = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["True", "6"]


class _CountingRaw(io.RawIOBase):
    def __init__(self, path: str, counter: list[int]) -> None:
        self.f, self.counter = open(path, "rb", buffering=0), counter

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.counter[0] += n
        return n

    def close(self) -> None:
        self.f.close()
        super().close()


@pytest.mark.parametrize("name", ["big.txt", "big.txt.gz"])
def test_streaming_reads_only_a_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    path = write_criteo_tsv(tmp_path / name, 20_000, seed=1)
    counter = [0]
    monkeypatch.setattr(criteo, "open", lambda p, mode: io.BufferedReader(_CountingRaw(p, counter)), raising=False)
    stream = CriteoTSVStream([path], batch_size=100, world_size=2, rank=1)
    first = next(iter(stream))
    assert first.labels.numel() == 100
    size = path.stat().st_size
    assert 0 < counter[0] < size / 20, f"read {counter[0]} of {size} bytes for one batch of 100 rows"
    counter[0] = 0
    assert sum(b.labels.numel() for b in stream) == 10_000 and counter[0] == size  # the counter sees every byte


def test_errors_name_the_file_and_line(tmp_path: Path) -> None:
    good = write_criteo_tsv(tmp_path / "good.txt", 5).read_text()
    (tmp_path / "short.txt").write_text(good + "1\t2\t3\n")
    with pytest.raises(ValueError, match=r"short\.txt:6: expected 40 tab-separated columns .*got 3\. HINT"):
        list(CriteoTSVStream([tmp_path / "short.txt"], batch_size=100))
    lines = good.splitlines()
    lines[1] = lines[1].rsplit("\t", 1)[0] + "\tnothex!"
    (tmp_path / "hex.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"hex\.txt:2: invalid literal .*nothex.*HINT"):
        list(CriteoTSVStream([tmp_path / "hex.txt"], batch_size=100))
    (tmp_path / "first.txt").write_text("1\t2\n" + good)
    with pytest.raises(ValueError, match=r"first\.txt:1: got 2 tab-separated columns, expected 40 .* or 39"):
        list(CriteoTSVStream([tmp_path / "first.txt"], batch_size=100))
    lines = good.splitlines()
    (tmp_path / "mixed.txt").write_text("".join(line.split("\t", 1)[1] + "\n" for line in lines[:3]) + lines[3] + "\n")
    with pytest.raises(ValueError, match=r"mixed\.txt:4: expected 39 tab-separated columns \(13 integers"):
        list(CriteoTSVStream([tmp_path / "mixed.txt"], batch_size=100))


def test_missing_inputs_and_bad_config(tmp_path: Path) -> None:
    """Missing inputs are named by ``check_files`` (the CLI calls it before any rank starts) and by the loaders."""
    with pytest.raises(FileNotFoundError, match=r"train input '.*nope\.txt' does not exist; expected a Criteo TSV"):
        CriteoDataModule(train=[str(tmp_path / "nope.txt")]).check_files()
    with pytest.raises(FileNotFoundError, match=r"val pattern '.*day_\*\.gz' matches no file"):
        CriteoDataModule(val=[str(tmp_path / "day_*.gz")]).val_dataloader()
    write_criteo_tsv(tmp_path / "d.txt", 20)
    tsv_to_npy(tmp_path / "d.txt", tmp_path / "day_0")
    (tmp_path / "day_0_sparse.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"day_0_sparse\.npy' does not exist; expected the \.npy set"):
        CriteoDataModule(test=[str(tmp_path / "day_0")]).check_files()
    np.save(tmp_path / "day_0_sparse.npy", np.zeros((20, 25), dtype=np.int64))
    with pytest.raises(ValueError, match=r"day_0_\*\.npy have shapes .*\(20, 25\)"):
        CriteoNpyDataset([tmp_path / "day_0"])
    with pytest.raises(ValueError, match="list of 26"):
        CriteoDataModule(num_embeddings=[10, 20])
    with pytest.raises(ValueError, match="no predict files given. HINT"):
        CriteoDataModule(train=[str(tmp_path / "d.txt")]).predict_dataloader()
    assert CriteoDataModule(train=[str(tmp_path / "d.txt")]).val_dataloader() == []  # fit without validation


def test_datamodule_layouts_ranks_and_features(tmp_path: Path) -> None:
    (tmp_path / "npy").mkdir()
    for day in range(2):
        tsv_to_npy(write_criteo_tsv(tmp_path / f"day_{day}", 150, seed=day), tmp_path / "npy" / f"d{day}")
    tsv = CriteoDataModule(train=[str(tmp_path / "day_*")], num_embeddings=BIG, layout="tsv")
    tsv_rows = _rows(tsv.train_dataloader())
    # a glob over the .npy files collapses to their prefixes; "auto" picks .npy; training data is shuffled
    dm = CriteoDataModule(
        train=[str(tmp_path / "npy" / "d*")],
        val=[str(tmp_path / "npy" / "d*_dense.npy")],
        num_embeddings=BIG,
        batch_size=64,
    )
    train, val = _rows(dm.train_dataloader()), _rows(dm.val_dataloader())
    assert val == tsv_rows and sorted(train) == sorted(tsv_rows) and train != tsv_rows and len(tsv_rows) == 300
    # the DataModule hands the trainer's rank and world size to the stream
    dm = CriteoDataModule(train=[str(tmp_path / "day_0")], num_embeddings=BIG, batch_size=50)
    dm.trainer = types.SimpleNamespace(global_rank=1, world_size=2)
    assert _rows(dm.train_dataloader()) == tsv_rows[50:100] + tsv_rows[125:150]
    dm = CriteoDataModule(train=[str(tmp_path / "day_0")], num_embeddings=list(range(1, 27)))
    assert [(f.name, f.num_embeddings) for f in dm.sparse_features] == [(f"cat_{i}", i + 1) for i in range(26)]
    assert dm.num_dense_features == 13
    ids = next(iter(dm.train_dataloader())).sparse_features
    assert all(int(ids[f"cat_{i}"].values().max()) <= i for i in range(26))


def test_npy_dataset_pickles_without_its_data(tmp_path: Path) -> None:
    write_criteo_tsv(tmp_path / "d.txt", 2000)
    tsv_to_npy(tmp_path / "d.txt", tmp_path / "day_0")
    ds = CriteoNpyDataset([tmp_path / "day_0"], 1000)
    batch = ds[torch.arange(10)]
    data = pickle.dumps(ds)
    assert len(data) < 5_000, f"pickled {len(data)} bytes: the memory maps were copied"
    _assert_same_batch(pickle.loads(data)[torch.arange(10)], batch)
