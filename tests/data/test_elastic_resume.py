"""Elastic resume (issue 46): a job saved mid-epoch on N ranks x W workers goes on on M ranks x V workers and reads
every row the epoch has left exactly once; what cannot be exact is still refused by name.

Every row carries its id (a dense column ``rid``, ``id / 1024`` so that a float32 holds it exactly); a callback
records the ids of each trained batch on each rank. A chain of fits, each resumed from the one before's mid-epoch
checkpoint, is cut at the checkpoints it resumed from; the ids trained along it, per epoch, must be the epoch's rows,
once each. The loader-level tests (no processes) do the same for layouts a fit would take longer to reach.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_rec import RecShardStrategy
from lightning_rec.data import CriteoDataModule, TabularDataModule, write_criteo_tsv
from lightning_rec.data.base import RecDataModule
from lightning_rec.errors import CheckpointError
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.dist import run_ranks
from tests.helpers.models import local_weights, tiny_dlrm

ROWS = 150
BATCH = 8
EPOCHS = 2
SCALE = 1024  # rid = id / SCALE, exact in float32

SCHEMA = {
    "labels": [{"column": "click"}],
    "dense": [{"column": "rid"}, {"column": "price"}],
    "sparse": [{"column": "user", "ids": "vocab"}, {"column": "tags", "ids": "vocab", "list": True}],
}


def _table_file(tmp: Path, rows: int = ROWS) -> str:
    """``rows`` rows with their ids, in row groups of 25 (units the stream shuffles); written once."""
    path = tmp / f"clicks{rows}.parquet"
    if not path.exists():
        ids = range(rows)
        table = pa.table(
            {
                "click": [float((i * 7) % 3 == 0) for i in ids],
                "rid": [i / SCALE for i in ids],
                "price": [float(i % 17) / 17 for i in ids],
                "user": [f"u{(i * 13) % 41}" for i in ids],
                "tags": [[f"t{(i + k) % 9}" for k in range(i % 3)] for i in ids],
            }
        )
        pq.write_table(table, path, row_group_size=25)
    return str(path)


def _dm(tmp: Path, stream: bool, workers: int, rows: int = ROWS, **kw: Any) -> TabularDataModule:
    kw = {"window": 2, **kw} if stream else kw  # small windows: a checkpoint falls inside a permuted one
    return TabularDataModule(
        schema=SCHEMA,
        train=[_table_file(tmp, rows)],
        stream=stream,
        batch_size=kw.pop("batch_size", BATCH),
        num_workers=workers,
        **kw,
    )


def _ids(batch: Any) -> list[int]:
    return torch.round(batch.dense_features[:, 0] * SCALE).long().tolist()


class RowIds(L.Callback):
    """Records each trained step's ``[epoch, step, row ids]`` and loss on this rank."""

    def __init__(self) -> None:
        self.steps: list[list[Any]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
        self.steps.append([trainer.current_epoch, trainer.global_step - 1, _ids(batch)])
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def _ckpt(out: Path, tag: str, step: int) -> Path:
    return next((out / tag).glob(f"step={step}.*"))


def _fit(out: Path, rank: int, devices: int, run: dict[str, Any]) -> dict[str, Any]:
    """One fit of ``run`` (``tag``, ``stream``, ``workers``, optionally ``resume``: ``[tag, step]``), saving a
    checkpoint every ``save_every`` steps into ``out/<tag>``; its steps and losses on this rank (weights into
    ``out``)."""
    dm = _dm(out, run["stream"], run["workers"])
    L.seed_everything(7)
    model = tiny_dlrm(dm)
    rows = RowIds()
    every = run.get("save_every")  # only the checkpoints a later run resumes from: each save costs
    saver = ModelCheckpoint(dirpath=out / run["tag"], every_n_train_steps=every, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(
        **{**QUIET_TRAINER, "enable_checkpointing": every is not None},
        accelerator="cpu",
        devices=devices,
        strategy=RecShardStrategy(),
        max_epochs=EPOCHS,
        limit_val_batches=0,
        callbacks=[rows] if every is None else [saver, rows],
    )
    resume = run.get("resume")
    trainer.fit(model, dm, ckpt_path=None if resume is None else _ckpt(out, *resume))
    torch.save(local_weights(model), out / f"{run['tag']}.weights{rank}.pt")
    return {"steps": rows.steps, "losses": rows.losses}


def fits(rank: int, world_size: int, out_dir: Path, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Scenario: the ``runs`` in turn on ``world_size`` ranks; by tag, this rank's steps and losses."""
    return {run["tag"]: _fit(out_dir, rank, world_size, run) for run in runs}


# The chains: streamed 1x2 -> 2x2 (1 -> 2 ranks) -> 1x0 (2 -> 1 rank, 2 -> 0 workers) -> 1x2 (0 -> 2 workers), each
# from its predecessor's checkpoint at the step named; "s4" resumes "s2" on its own layout (an exact continuation).
# In memory: 1 -> 2 -> 1 ranks.
STREAMED = [("s0", 1, 2, None), ("s1", 2, 2, 6), ("s2", 1, 0, 9), ("s3", 1, 2, 12)]
IN_MEMORY = [("m0", 1, 0, None), ("m1", 2, 0, 6), ("m2", 1, 0, 9)]


def _runs(chain: list[tuple[str, int, int, int | None]], stream: bool, ranks: int) -> list[dict[str, Any]]:
    runs = []
    for i, (tag, devices, workers, step) in enumerate(chain):
        if devices == ranks:
            resume = None if step is None else [chain[i - 1][0], step]
            every = chain[i + 1][3] if i + 1 < len(chain) else None
            runs.append({"tag": tag, "stream": stream, "workers": workers, "resume": resume, "save_every": every})
    return runs


@pytest.fixture(scope="module")
def chains(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    """Every run of both chains: the 1-rank ones in this process, the 2-rank ones in one launch; by tag, each
    rank's record."""
    out = tmp_path_factory.mktemp("elastic")
    _table_file(out)
    results: dict[str, list[dict[str, Any]]] = {}

    def ranks(runs: list[dict[str, Any]], world_size: int) -> None:
        for by_tag in run_ranks(fits, world_size, out, timeout=300, runs=runs):
            for tag, record in by_tag.items():
                results.setdefault(tag, []).append(record)

    ranks(_runs(STREAMED, True, 1)[:1] + _runs(IN_MEMORY, False, 1)[:1], 1)
    ranks(_runs(STREAMED, True, 2) + _runs(IN_MEMORY, False, 2), 2)
    later = _runs(STREAMED, True, 1)[1:] + _runs(IN_MEMORY, False, 1)[1:]
    later.append({"tag": "s4", "stream": True, "workers": 0, "resume": ["s2", 12]})
    ranks(later, 1)
    return out, results


def _epochs_read(chain: list[tuple[str, int, int, int | None]], results: dict[str, list[dict[str, Any]]]) -> dict:
    """The row ids trained along ``chain`` (each run up to the step its successor resumed from), per epoch."""
    read: dict[int, list[int]] = {}
    for i, (tag, _, _, start) in enumerate(chain):
        stop = chain[i + 1][3] if i + 1 < len(chain) else None
        for record in results[tag]:
            for epoch, step, ids in record["steps"]:
                assert start is None or step >= start, f"{tag} trained step {step} before its checkpoint's"
                if stop is None or step < stop:
                    read.setdefault(epoch, []).extend(ids)
    return read


@pytest.mark.dist
@pytest.mark.parametrize("chain", [STREAMED, IN_MEMORY], ids=["streamed", "in_memory"])
def test_every_row_of_an_epoch_is_read_once_across_resumes_on_other_layouts(
    chains: tuple[Path, dict[str, list[dict[str, Any]]]], chain: list[tuple[str, int, int, int | None]]
) -> None:
    """Along the chain, and along each of its beginnings taken to the end of its last run (a run resumed on more
    processes has more steps left in that epoch than the layout's whole epoch: none may be cut)."""
    _, results = chains
    for end in range(1, len(chain) + 1):
        read = _epochs_read(chain[:end], results)
        assert sorted(read) == list(range(EPOCHS))
        for epoch, ids in read.items():
            twice = sorted(i for i, n in Counter(ids).items() if n > 1)
            never = sorted(set(range(ROWS)) - set(ids))
            assert not twice and not never, (
                f"up to {chain[end - 1][0]}, epoch {epoch}: read twice {twice}, never {never}"
            )


@pytest.mark.dist
def test_the_epoch_after_an_elastic_one_is_whole_on_the_new_layout(
    chains: tuple[Path, dict[str, list[dict[str, Any]]]],
) -> None:
    """The resumed epoch is as long as its rows need (13 steps on 2 ranks, past their 10; 17 on 1 rank, short of
    its 19); the next epoch has the new layout's own length, every rank stepping together."""
    _, results = chains
    for tag, devices in (("s1", 2), ("s2", 1), ("m1", 2), ("m2", 1)):
        whole = math.ceil(math.ceil(ROWS / devices) / BATCH)
        per_rank = [[s for s in record["steps"] if s[0] == 1] for record in results[tag]]
        assert [len(steps) for steps in per_rank] == [whole] * devices, tag
        last = [max(s[1] for s in record["steps"] if s[0] == 0) for record in results[tag]]
        assert len(set(last)) == 1, f"{tag}: the ranks ended the resumed epoch at steps {last}"


@pytest.mark.dist
def test_a_resumed_elastic_epoch_resumes_exactly_on_its_own_layout(
    chains: tuple[Path, dict[str, list[dict[str, Any]]]],
) -> None:
    """The run "s4" resumes "s2" (itself resumed elastically) from its step 12 on s2's layout: the same batches, losses and
    final weights bitwise, as any resume of an unchanged layout."""
    out, results = chains
    (s2,), (s4,) = results["s2"], results["s4"]
    after = [s for s in s2["steps"] if s[1] >= 12]
    assert s4["steps"] == after
    assert s4["losses"] == s2["losses"][len(s2["steps"]) - len(after) :]
    a, b = torch.load(out / "s2.weights0.pt"), torch.load(out / "s4.weights0.pt")
    assert a.keys() == b.keys() and all(
        torch.equal(ta, tb) for k in a for (_, ta), (_, tb) in zip(a[k], b[k], strict=True)
    )


@pytest.mark.dist
def test_the_documented_command_resumes_a_two_process_checkpoint_on_one(
    chains: tuple[Path, dict[str, list[dict[str, Any]]]], tmp_path: Path
) -> None:
    """docs/scaling-out.md's command (``lightning-rec fit --config my.yaml --trainer.devices=1
    --data.init_args.num_workers=0 --ckpt_path=...``) on "s1"'s checkpoint at step 9 (2 processes x 2 workers),
    for the rest of that epoch: with what s0 and s1 trained before, every row once."""
    from lightning_rec._cli import run

    out, results = chains
    config = {
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "recshard", "max_epochs": 1},
        "model": {
            "class_path": "lightning_rec.models.DLRMModule",
            "init_args": {"embedding_dim": 8, "dense_arch_layer_sizes": [8], "over_arch_layer_sizes": [8, 1]},
        },
        "data": {
            "class_path": "lightning_rec.data.TabularDataModule",
            "init_args": {"schema": SCHEMA, "train": [_table_file(out)], "stream": True, "window": 2},
        },
    }
    config["data"]["init_args"].update(batch_size=BATCH, num_workers=2)
    (tmp_path / "my.yaml").write_text(yaml.safe_dump(config))
    command = "fit --config my.yaml --trainer.devices=1 --data.init_args.num_workers=0 --ckpt_path=" + str(
        _ckpt(out, "s1", 9)
    )
    quiet = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0"]
    quiet.append("--trainer.callbacks+=tests.data.test_elastic_resume.RowIds")  # records the ids it trains
    cli = run([*command.replace("my.yaml", str(tmp_path / "my.yaml")).split(), *quiet])
    assert cli is not None
    trained = next(c for c in cli.trainer.callbacks if isinstance(c, RowIds))
    chain = [("s0", 1, 2, None), ("s1", 2, 2, 6), ("cli", 1, 0, 9)]
    read = _epochs_read(chain, {**results, "cli": [{"steps": trained.steps}]})
    assert sorted(read[0]) == list(range(ROWS))


# ---- the loaders alone (no processes): more layouts than fits could afford -------------------------------------


def _loader(dm: RecDataModule, rank: int, world_size: int) -> Any:
    """The training loader of ``dm`` as rank ``rank`` of ``world_size`` (what a trainer tells it, without one)."""
    dm.trainer = SimpleNamespace(global_rank=rank, world_size=world_size)  # type: ignore[assignment]
    dm.setup("fit")
    return dm.dataloader("train")


def _read_leg(tmp: Path, stream: bool, world_size: int, batch: int, state: dict | None, steps: int | None, rows: int):
    """Every rank of one leg of epoch 1 reads ``steps`` batches (all: ``None``) after loading ``state``; the ids read
    and rank 0's state after."""
    ids: list[int] = []
    saved = None
    lengths = set()
    for rank in range(world_size):
        loader = _loader(_dm(tmp, stream, 0, rows, batch_size=batch), rank, world_size)
        if state is not None:
            loader.load_state_dict(state)
        loader.set_epoch(1)
        lengths.add(len(loader))
        for batch_ in itertools.islice(loader, steps):
            ids += _ids(batch_)
        saved = saved or loader.state_dict()
    assert len(lengths) == 1, "every rank has the same number of batches"
    return ids, saved


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "in_memory"])
@pytest.mark.parametrize(
    "legs",
    [[(2, 8, 3), (1, 8, None)], [(1, 8, 5), (3, 8, None)], [(3, 8, 2), (2, 5, 3), (4, 8, 1), (1, 8, None)]],
    ids=["2-1", "1-3", "3-2-4-1 with batch sizes"],
)
def test_a_loader_saved_on_one_layout_reads_the_rest_of_its_epoch_once_on_another(
    tmp_path: Path, stream: bool, legs: list[tuple[int, int, int | None]]
) -> None:
    """Each leg: ``(ranks, batch size, steps before the next checkpoint)``; 151 rows (no layout divides them)."""
    rows = 151
    ids: list[int] = []
    state = None
    for world_size, batch, steps in legs:
        read, state = _read_leg(tmp_path, stream, world_size, batch, state, steps, rows)
        ids += read
    assert sorted(ids) == list(range(rows))


def test_what_cannot_resume_exactly_is_still_refused_by_name(tmp_path: Path) -> None:
    """Other data (another row count), another stream ``window``, fewer rows left than ranks, and a loader that
    cannot restripe (the Criteo TSV stream, read in rounds) are refused naming what differs; nothing changes."""
    _, state = _read_leg(tmp_path, True, 2, 8, None, 3, ROWS)
    loader = _loader(_dm(tmp_path, True, 0, ROWS + 1), 0, 1)
    before = loader.state_dict()
    with pytest.raises(CheckpointError, match=rf"over {ROWS} rows; this run's data has {ROWS + 1}"):
        loader.load_state_dict(state)
    assert loader.state_dict() == before, "nothing changed"
    loader = _loader(_dm(tmp_path, True, 0, window=4), 0, 1)
    with pytest.raises(CheckpointError, match=r"window=2; this run has window=4.*HINT: resume with window=2"):
        loader.load_state_dict(state)
    _, state = _read_leg(tmp_path, False, 1, 8, None, 18, ROWS)  # 18 of 19 batches (7 or 8 rows): 7 rows left
    with pytest.raises(CheckpointError, match=r"with 7 row\(s\) of that epoch left, fewer than this run's 8 processes"):
        _loader(_dm(tmp_path, False, 0), 0, 8).load_state_dict(state)
    tsv = CriteoDataModule(train=[str(write_criteo_tsv(tmp_path / "day_0", 300, seed=3))], num_embeddings=50)
    tsv.batch_size = 50
    criteo = _loader(tsv, 0, 1)
    with pytest.raises(CheckpointError, match=r"2 process\(es\); this run has 1 process\(es\).*devices x num_nodes=2"):
        criteo.load_state_dict({**criteo.state_dict(), "epoch": 0, "served": 2, "world_size": 2})
