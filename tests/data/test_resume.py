"""Every shipped DataModule resumes a fit exactly, mid-epoch included (issue 34, findings 8-10).

An operator's resume: a fit saves checkpoints every few steps (``ModelCheckpoint(every_n_train_steps=...)``), and
``fit(ckpt_path=<a checkpoint>)`` carries on from one. The resumed run must train the same batches, in the same
order, as the uninterrupted run did after that checkpoint: its per-step losses and final weights are compared
bitwise. A checkpoint saved mid-epoch by a run of another layout (rank count; a stream's worker count) goes on with
the rows that epoch has left (``tests/data/test_elastic_resume.py``); an in-memory DataModule's worker count does not
change its order, so that resume is exactly the uninterrupted run.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_rec import RecShardStrategy
from lightning_rec.data import (
    CriteoDataModule,
    MovieLensDataModule,
    MovieLensRetrievalDataModule,
    MovieLensSequenceDataModule,
    SyntheticDataModule,
    SyntheticTable,
    TabularDataModule,
    write_criteo_tsv,
)
from lightning_rec.data.criteo import tsv_to_npy
from lightning_rec.errors import CheckpointError
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.data import movielens_dir
from tests.helpers.dist import run_ranks
from tests.helpers.models import local_weights, tiny_dlrm

EVERY = 3  # a checkpoint every 3 steps
LIMIT = 6  # training batches an epoch (the in-memory splits have more: a checkpoint at step 3 or 9 is mid-epoch)
EPOCHS = 2

SCHEMA = {
    "labels": [{"column": "click"}],
    "dense": [{"column": "price"}],
    "sparse": [
        {"column": "user", "ids": "vocab"},
        {"column": "tags", "ids": "vocab", "list": True},
    ],
}


def _table_file(tmp: Path) -> str:
    """300 rows of your own data in a Parquet file (written once: ranks may share ``tmp``)."""
    path = tmp / "clicks.parquet"
    if path.exists():
        return str(path)
    rows = range(300)
    table = pa.table(
        {
            "click": [float((i * 7) % 3 == 0) for i in rows],
            "price": [float(i % 17) / 17 for i in rows],
            "user": [f"u{(i * 13) % 41}" for i in rows],
            "tags": [[f"t{(i + k) % 9}" for k in range(i % 3)] for i in rows],
        }
    )
    pq.write_table(table, path)
    return str(path)


def _tabular(tmp: Path, **kw: Any) -> TabularDataModule:
    """In memory (the default), split by a rule: what ``examples/configs/movielens_parquet.yaml`` does."""
    split = {"random": {"val": 0.2, "test": 0.0, "seed": 1}}
    return TabularDataModule(schema=SCHEMA, files=[_table_file(tmp)], split=split, batch_size=16, **kw)


def _movielens_dir(tmp: Path) -> str:
    """MovieLens-100K's users and movies with its first 6,000 ratings (a smaller, quicker copy)."""
    src, dst = movielens_dir(), tmp / "ml-100k"
    dst.mkdir(exist_ok=True)
    for name in ("ml-100k.user", "ml-100k.item"):
        shutil.copy(src / name, dst / name)
    with open(src / "ml-100k.inter") as f:
        (dst / "ml-100k.inter").write_text("".join(line for _, line in zip(range(6001), f)))
    return str(dst)


def _criteo(tmp: Path, layout: str) -> CriteoDataModule:
    tsv = write_criteo_tsv(tmp / "day_0", 700, seed=3)
    if layout == "tsv":  # streamed in file order: no length, so Lightning fetches a batch ahead
        return CriteoDataModule(train=[str(tsv)], num_embeddings=50, batch_size=100)
    (tmp / "npy").mkdir(exist_ok=True)
    tsv_to_npy([tsv], tmp / "npy" / "day_0")
    return CriteoDataModule(train=[str(tmp / "npy" / "day_0")], num_embeddings=50, batch_size=60)


def _dlrm(dm: Any) -> Any:
    return tiny_dlrm(dm)


def _two_tower(dm: Any) -> Any:
    from lightning_rec.models.two_tower import TwoTowerModule

    return TwoTowerModule(dm.sparse_features, embedding_dim=8, query_layer_sizes=[8], candidate_layer_sizes=[8])


def _sasrec(dm: Any) -> Any:
    from lightning_rec.models.sequential import SequentialRecModule

    return SequentialRecModule(dm.sparse_features, embedding_dim=8, max_len=5, num_blocks=1, num_heads=1, dropout=0.0)


# name -> (DataModule in tmp, model for it, training batches an epoch: None takes LIMIT of more)
CASES: dict[str, tuple[Callable[[Path], Any], Callable[[Any], Any], int | None]] = {
    "tabular": (_tabular, _dlrm, None),
    "synthetic": (
        lambda tmp: SyntheticDataModule(
            [SyntheticTable("item", 200, distribution="power_law"), SyntheticTable("tags", 30, multi_hot=True)],
            num_dense_features=2,
            train_rows=400,
            val_rows=50,
            batch_size=32,
        ),
        _dlrm,
        None,
    ),
    "movielens": (lambda tmp: MovieLensDataModule(_movielens_dir(tmp), download=False, batch_size=256), _dlrm, None),
    "movielens_retrieval": (
        lambda tmp: MovieLensRetrievalDataModule(_movielens_dir(tmp), download=False, batch_size=256),
        _two_tower,
        None,
    ),
    "movielens_sequential": (
        lambda tmp: MovieLensSequenceDataModule(
            _movielens_dir(tmp), download=False, max_len=5, num_negatives=4, batch_size=8
        ),
        _sasrec,
        None,
    ),
    "criteo_npy": (lambda tmp: _criteo(tmp, "npy"), _dlrm, None),
    "criteo_tsv": (lambda tmp: _criteo(tmp, "tsv"), _dlrm, 7),  # 700 rows, 100 a batch: 7 batches an epoch
    "tabular_streamed": (lambda tmp: _stream(tmp), _dlrm, None),
}


class _Record(L.Callback):
    """Each training step's loss, and whether the run got past setup (a refused resume does not)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss) if loss is not None else float(trainer.callback_metrics["train_loss"]))


def _fit(
    tmp: Path,
    case: str,
    ckpt: Path | None = None,
    *,
    limit: int | None = LIMIT,
    devices: int = 1,
    pipeline: bool = False,
    **dm_kw: Any,
) -> tuple[list[float], dict[str, list], Any]:
    """Fit ``case`` for 2 epochs (from ``ckpt``) on ``devices`` ranks, saving a checkpoint every 3 steps into
    ``tmp/ckpt``."""
    make_dm, make_model, _ = CASES[case]
    dm = make_dm(tmp)
    for key, value in dm_kw.items():
        setattr(dm, key, value)
    L.seed_everything(7)
    model = make_model(dm)
    record = _Record()
    saver = ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=EVERY, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(
        **{**QUIET_TRAINER, "enable_checkpointing": True},
        accelerator="cpu",
        devices=devices,
        strategy=RecShardStrategy(pipeline=pipeline),
        max_epochs=EPOCHS,
        limit_train_batches=limit,
        limit_val_batches=0,
        callbacks=[saver, record],
    )
    trainer.fit(model, dm, ckpt_path=ckpt)
    return record.losses, local_weights(model), trainer


def _same_weights(a: dict[str, list], b: dict[str, list]) -> bool:
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and all(oa == ob and torch.equal(ta, tb) for (oa, ta), (ob, tb) in zip(a[k], b[k]))
        for k in a
    )


def _step(tmp: Path, step: int) -> Path:
    return next((tmp / "ckpt").glob(f"step={step}*"))


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_fit_trains_what_the_uninterrupted_one_did(case: str, tmp_path: Path) -> None:
    """Findings 8 and 9: resumed at step 9 (mid second epoch) the losses after it and the final weights are bitwise
    those of the uninterrupted fit (before the fix: the in-memory epoch restarted from its first batch; the
    in-memory TabularDataModule failed with "there is no 'train' split")."""
    per_epoch = CASES[case][2]
    limit = None if per_epoch else LIMIT
    full, weights, _ = _fit(tmp_path, case, limit=limit)
    assert len(full) == EPOCHS * (per_epoch or LIMIT)
    resume_at = 3 * EVERY  # mid second epoch
    assert (per_epoch or LIMIT) < resume_at < 2 * (per_epoch or LIMIT)
    resumed, resumed_weights, _ = _fit(tmp_path, case, _step(tmp_path, resume_at), limit=limit)
    assert resumed == full[resume_at:], "the resumed run trains the batches the checkpoint had not seen"
    assert _same_weights(resumed_weights, weights)


def test_a_pipelined_fit_resumes_exactly(tmp_path: Path) -> None:
    """``pipeline=True`` takes one batch more from the loader than Lightning has (its input distribution overlaps
    the step before); the checkpoint counts only what Lightning trained."""
    full, weights, _ = _fit(tmp_path, "synthetic", pipeline=True)
    resumed, resumed_weights, _ = _fit(tmp_path, "synthetic", _step(tmp_path, 3 * EVERY), pipeline=True)
    assert resumed == full[3 * EVERY :], "the resumed run trains the batches the checkpoint had not seen"
    assert _same_weights(resumed_weights, weights)


def test_your_own_data_in_memory_resumes_from_any_checkpoint_and_validates_from_one(tmp_path: Path) -> None:
    """Finding 8: mid first epoch, at the first epoch's end, and ``validate(ckpt_path=...)``."""
    full, weights, trainer = _fit(tmp_path, "tabular")
    for step in (EVERY, LIMIT):
        resumed, resumed_weights, _ = _fit(tmp_path, "tabular", _step(tmp_path, step))
        assert resumed == full[step:], f"resumed at step {step}"
        assert _same_weights(resumed_weights, weights), f"resumed at step {step}"
    trainer.limit_val_batches = 1.0  # the fits ran no validation; this one runs every batch
    expected = trainer.validate(trainer.lightning_module, trainer.datamodule, verbose=False)
    dm = _tabular(tmp_path)
    L.seed_everything(7)
    checker = L.Trainer(**QUIET_TRAINER, accelerator="cpu", devices=1, strategy=RecShardStrategy())
    got = checker.validate(_dlrm(dm), dm, ckpt_path=_step(tmp_path, EPOCHS * LIMIT), verbose=False)
    assert got == expected, "validating from the last checkpoint is validating the fitted model"


@pytest.mark.dist  # 2 spawned DataLoader workers
def test_an_in_memory_resume_with_another_worker_count_is_exact(tmp_path: Path) -> None:
    """The sampler orders an in-memory epoch in the main process: saved with 2 workers, resumed with 0, exact."""
    full, weights, _ = _fit(tmp_path, "synthetic", num_workers=2)
    resumed, resumed_weights, _ = _fit(tmp_path, "synthetic", _step(tmp_path, LIMIT + EVERY), num_workers=0)
    assert resumed == full[LIMIT + EVERY :]
    assert _same_weights(resumed_weights, weights)


def _stream(tmp: Path, **kw: Any) -> TabularDataModule:
    path = _table_file(tmp)
    return TabularDataModule(schema=SCHEMA, train=[path], stream=True, batch_size=16, **kw)


def test_a_stream_refuses_a_mid_epoch_state_of_another_layout_that_does_not_say_its_rows(tmp_path: Path) -> None:
    """Finding 10, the loader itself: a mid-epoch state from 2 ranks (or 2 workers) saved before elastic resume (no
    ``rows``: which rows are left cannot be known) is refused naming both counts; the loader is left as it was. An
    epoch-end state, or one of the same layout, loads. (States that say their rows resume on any layout:
    ``tests/data/test_elastic_resume.py``.)"""
    dm = _stream(tmp_path)
    dm.setup("fit")
    loader = dm.dataloader("train")
    mine = loader.state_dict()
    assert (mine["world_size"], mine["num_workers"]) == (1, 0)
    old = {k: v for k, v in mine.items() if k not in ("rows", "legs")}
    with pytest.raises(CheckpointError, match=r"after batch 3 of epoch 1.* 2 process\(es\).*1 process\(es\)"):
        loader.load_state_dict({**old, "epoch": 1, "served": 3, "world_size": 2})
    with pytest.raises(CheckpointError, match=r"2 DataLoader worker\(s\); this run has 0 DataLoader worker\(s\)"):
        loader.load_state_dict({**old, "epoch": 1, "served": 3, "num_workers": 2})
    assert loader.state_dict() == mine and loader.epoch == 0, "nothing changed"
    first = [b.labels.tolist() for b in loader]
    loader.load_state_dict({**old, "epoch": 0, "served": len(loader), "world_size": 2})
    assert [b.labels.tolist() for b in loader] == first, "an ended epoch: any layout"
    loader.load_state_dict({**mine, "served": 3})
    assert [b.labels.tolist() for b in loader] == first[3:]


# ---- 2 ranks: the in-memory TabularDataModule (finding 8 happened on both ranks) --------------------------------


def two_rank_tabular(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    """Scenario: fit 2 epochs, then fit again from the mid-epoch checkpoint at step 3 and from the epoch-end one at
    step 6; each run's losses and this rank's final weights (saved to ``out_dir``)."""
    out: dict[str, Any] = {}
    for tag, step in (("full", None), ("mid", EVERY), ("end", LIMIT)):
        losses, weights, _ = _fit(out_dir, "tabular", None if step is None else _step(out_dir, step), devices=2)
        out[tag] = losses
        torch.save(weights, out_dir / f"{tag}.weights{rank}.pt")
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("two_rank_tabular")
    _table_file(out)  # before the ranks start, which both read it
    return out, run_ranks(two_rank_tabular, 2, out, timeout=180)


@pytest.mark.dist
def test_two_ranks_resume_your_own_data_in_memory_exactly(two_ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    out, results = two_ranks
    for r, result in enumerate(results):
        full = result["full"]
        assert len(full) == EPOCHS * LIMIT
        assert result["mid"] == full[EVERY:] and result["end"] == full[LIMIT:], f"rank {r}"
        for tag in ("mid", "end"):
            assert _same_weights(torch.load(out / f"{tag}.weights{r}.pt"), torch.load(out / f"full.weights{r}.pt"))


@pytest.mark.dist
def test_a_two_rank_mid_epoch_checkpoint_resumes_on_one_rank(
    two_ranks: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Issue 46 (finding 10 was a refusal): 2 ranks' checkpoint at step 3 goes on on 1 rank, the rest of that epoch
    restriped (row by row: ``tests/data/test_elastic_resume.py``) within ``limit_train_batches``, then a whole epoch."""
    out, _ = two_ranks
    shutil.copytree(out / "ckpt", tmp_path / "ckpt")
    losses, _, _ = _fit(tmp_path, "tabular", _step(tmp_path, EVERY))
    assert len(losses) == EPOCHS * LIMIT - EVERY


@pytest.mark.dist  # 2 spawned DataLoader workers
def test_a_criteo_tsv_stream_resumes_exactly_with_another_worker_count(tmp_path: Path) -> None:
    """Batch i of a Criteo TSV rank is the file's round i whatever the workers: saved with 0, resumed with 2, the
    epoch goes on at the next batch. Without a length Lightning fetches one batch ahead of its steps: after 3 steps
    it asked for 4 batches, and the state holds 3."""
    full = [b.dense_features.tolist() for b in _criteo(tmp_path, "tsv").train_dataloader()]
    assert len(full) == 7
    loader = _criteo(tmp_path, "tsv").train_dataloader()
    batches = iter(loader)
    for _ in range(4):
        next(batches)
    state = loader.state_dict()
    assert (state["served"], state["num_workers"]) == (3, 0)
    dm = _criteo(tmp_path, "tsv")
    dm.num_workers = 2
    resumed = dm.train_dataloader()
    resumed.load_state_dict(state)
    assert [b.dense_features.tolist() for b in resumed] == full[3:]
    assert [b.dense_features.tolist() for b in resumed] == full, "the next pass is a whole epoch"
