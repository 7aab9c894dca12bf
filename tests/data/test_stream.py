"""Streaming tables: Parquet row groups and CSV byte ranges split over ranks and workers so that every rank runs the
same number of batches and every row is read once per epoch; seeded shuffling; exact mid-epoch resumption."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

from lightning_rec.data import TabularDataModule
from lightning_rec.data.stream import StreamLoader, list_units
from tests.helpers.models import tiny_dlrm

SCHEMA = {
    "labels": [{"column": "click"}],
    "dense": [{"column": "rid"}],  # the row's number, to see which rows came
    "sparse": [
        {"column": "user", "ids": "hash", "num_embeddings": 1000},
        {"column": "tags", "ids": "vocab", "list": True, "delimiter": ";"},
    ],
}


def _table(first: int, n: int) -> pa.Table:
    return pa.table(
        {
            "click": [float(i % 2) for i in range(first, first + n)],
            "rid": [float(i) for i in range(first, first + n)],
            "user": [f"u{i % 13}" for i in range(first, first + n)],
            "tags": [[f"t{(i + k) % 5}" for k in range(i % 3)] for i in range(first, first + n)],
        }
    )


def _files(tmp: Path) -> list[str]:
    """1,003 rows: a Parquet file of row groups of 97, a CSV file cut into ~600-byte ranges, a gzip CSV."""
    pq.write_table(_table(0, 500), tmp / "a.parquet", row_group_size=97)
    for name, first, n in (("b.csv", 500, 400), ("c.csv", 900, 103)):
        t = _table(first, n)
        t = t.set_column(3, "tags", pa.array([";".join(x) for x in t.column("tags").to_pylist()]))
        pacsv.write_csv(t, tmp / name)
    with open(tmp / "c.csv", "rb") as f, gzip.open(tmp / "c.csv.gz", "wb") as g:
        g.write(f.read())
    (tmp / "c.csv").unlink()
    return [str(tmp / "a.parquet"), str(tmp / "b.csv"), str(tmp / "c.csv.gz")]


def _module(tmp: Path, **kw: Any) -> TabularDataModule:
    files = _files(tmp)
    args: dict[str, Any] = dict(schema=SCHEMA, train=files, val=files[:1], stream=True, chunk_bytes=600)
    dm = TabularDataModule(**{**args, **kw})
    dm.setup("fit")
    return dm


def _loader(dm: TabularDataModule, rank: int, world: int, split: str = "train") -> StreamLoader:
    dm.__dict__["_rank_world"] = (rank, world)
    type(dm).rank_and_world_size = property(lambda self: self.__dict__.get("_rank_world", (0, 1)))  # no trainer here
    return dm.dataloader(split)


def _rids(batches: list[Any]) -> list[int]:
    return [int(x) for b in batches for x in b.dense_features[:, 0].tolist()]


def test_units_cover_every_row_with_their_counts(tmp_path: Path) -> None:
    units = list_units(_files(tmp_path), chunk_bytes=600)
    assert sum(u.rows for u in units) == 1003
    assert [u.rows for u in units if u.row_group is not None] == [97] * 5 + [15]
    csv = [u for u in units if u.file.endswith("b.csv")]
    assert len(csv) > 5 and csv[0].first_line == 2 and csv[1].first_line == 2 + csv[0].rows


@pytest.mark.parametrize("world", [1, 3])
def test_every_rank_runs_as_many_batches_and_every_row_comes_once(world: int, tmp_path: Path) -> None:
    dm = _module(tmp_path, batch_size=64, window=2)
    per_rank = [list(_loader(dm, r, world)) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == len(_loader(dm, 0, world))
    assert all(len(b.labels) <= 64 for batches in per_rank for b in batches)
    assert sorted(x for batches in per_rank for x in _rids(batches)) == list(range(1003))


def test_streamed_rows_are_the_in_memory_rows(tmp_path: Path) -> None:
    streamed = list(_loader(_module(tmp_path, batch_size=100), 0, 1))
    files = [str(tmp_path / n) for n in ("a.parquet", "b.csv", "c.csv.gz")]
    memory = TabularDataModule(schema=SCHEMA, train=files)
    memory.setup("fit")
    whole = memory.split("train")[torch.arange(1003)]
    by_rid = {}
    for b in streamed:
        feats = b.sparse_features.to_dict()
        users, tags = feats["user"].to_dense(), feats["tags"].to_dense()
        for i, rid in enumerate(_rids([b])):
            by_rid[rid] = (users[i].tolist(), tags[i].tolist())
    feats = whole.sparse_features.to_dict()
    users, tags = feats["user"].to_dense(), feats["tags"].to_dense()
    assert by_rid == {i: (users[i].tolist(), tags[i].tolist()) for i in range(1003)}


def test_shuffling_is_seeded_and_differs_by_epoch(tmp_path: Path) -> None:
    dm = _module(tmp_path, batch_size=50)
    loader = _loader(dm, 0, 1)
    first = _rids(list(loader))
    assert _rids(list(loader)) == first, "the same epoch again: the same order"
    loader.set_epoch(1)
    second = _rids(list(loader))
    assert second != first and sorted(second) == sorted(first) == list(range(1003))
    assert _rids(list(_loader(dm, 0, 1, "val"))) == list(range(500)), "validation is not shuffled"


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.dist)])  # 2 spawned worker processes
def test_a_mid_epoch_checkpoint_resumes_at_the_next_batch(workers: int, tmp_path: Path) -> None:
    dm = _module(tmp_path, batch_size=40, window=3, num_workers=workers)
    loader = _loader(dm, 1, 2)
    loader.set_epoch(2)
    full = [_rids([b]) for b in loader]
    if workers == 0:
        other = _loader(dm, 0, 2)
        other.set_epoch(2)
        shared = sorted([x for b in full for x in b] + _rids(list(other)))
        assert shared == list(range(1003)), "the two ranks of epoch 2 share the rows"
        it = iter(loader)
        for _ in range(5):
            next(it)
        saved = loader.state_dict()
        assert (saved["epoch"], saved["served"], saved["finished"]) == (2, 5, False)
        assert (saved["world_size"], saved["num_workers"], saved["batch_size"]) == (2, 0, 40), "the layout, checked"
    state = {"epoch": 2, "served": 5}  # what Lightning saved after the fifth batch
    resumed = _loader(dm, 1, 2)
    resumed.load_state_dict(state)
    assert [_rids([b]) for b in resumed] == full[5:]


class _Losses:
    def __init__(self) -> None:
        import lightning as L

        losses: list[float] = []

        class Recorder(L.Callback):
            def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
                losses.append(float(outputs["loss"]))

        self.callback, self.losses = Recorder(), losses


def test_lightning_resumes_a_streamed_epoch_at_the_batch_after_its_checkpoint(tmp_path: Path) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_rec
    from lightning_rec.testing import QUIET_TRAINER

    files = _files(tmp_path)

    def fit(ckpt: Any = None) -> list[float]:
        dm = TabularDataModule(schema=SCHEMA, train=files, val=files[:1], stream=True, chunk_bytes=600, batch_size=100)
        L.seed_everything(7)
        model = tiny_dlrm(dm, 1)
        losses = _Losses()
        saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
        kw = {**QUIET_TRAINER, "enable_checkpointing": True}
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=lightning_rec.RecShardStrategy(),
            max_epochs=2,
            limit_val_batches=0,
            callbacks=[saver, losses.callback],
            **kw,
        )
        trainer.fit(model, dm, ckpt_path=ckpt)
        return losses.losses

    full = fit()
    assert len(full) == 22, "11 batches an epoch"
    resumed = fit(next((tmp_path / "ckpt").glob("step=8*")))  # step 8: mid first epoch
    assert resumed == full[8:], "the resumed run trains the batches the checkpoint had not seen, on the same weights"


@pytest.mark.dist  # 2 spawned worker processes
def test_persistent_workers_read_each_pass_s_epoch_and_resume_point(tmp_path: Path) -> None:
    """One loader, its two workers started once: every pass (training epochs, a resumed epoch, validation between
    them) gives the batches a fresh loader gives (which the tests above check: every row once per epoch, exact
    resumption)."""
    dm = _module(tmp_path, batch_size=40, window=3, num_workers=2)

    def fresh(epoch: int, served: int = 0) -> list[list[int]]:
        loader = _loader(dm, 1, 2)
        loader.load_state_dict({"epoch": epoch, "served": served})
        return [_rids([b]) for b in loader]

    kept, val = _loader(dm, 1, 2), _loader(dm, 1, 2, "val")
    assert kept.dataloader.persistent_workers and val.dataloader.persistent_workers
    seen, validated = [], []
    for epoch in (0, 1):
        kept.set_epoch(epoch)
        seen.append([_rids([b]) for b in kept])
        validated.append(_rids(list(val)))
    workers = kept.dataloader._iterator._workers  # the same processes serve every pass from here on
    assert seen[0] == fresh(0) and seen[1] == fresh(1) and seen[0] != seen[1], "each epoch's own order"
    assert validated[0] == validated[1] == _rids(list(_loader(dm, 1, 2, "val")))
    kept.load_state_dict({"epoch": 4, "served": 5})  # a mid-epoch checkpoint, loaded into a loader already running
    kept.set_epoch(4)
    assert [_rids([b]) for b in kept] == fresh(4, 5)
    kept.set_epoch(5)
    assert [_rids([b]) for b in kept] == fresh(5), "the pass after a resumed one starts at its first batch"
    assert kept.dataloader._iterator._workers == workers
