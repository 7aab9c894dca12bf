"""``ModelPublisher`` (issue 47): versions written while a model trains, on 1 and 2 ranks.

What is checked, on models nobody wrote for publishing (the zoo's DLRM-DCNv2 on MovieLens rows, sharded column-wise,
table-wise and data-parallel on 2 ranks; the TorchRec-tutorial model with a table two features share):

- the directory: versions ``1..N`` with their manifests (step, world size, checksums of every part), fulls every
  ``full_every`` versions, ``LATEST`` on the newest complete chain, retention that keeps it;
- each delta holds exactly the rows the batches since the previous version touched (the union over ranks), and a
  server that starts from the trained state at a full's step and applies the deltas after it holds, bit for bit, the
  bytes a full export of each later step holds (``artifact_rows`` of the whole tables, int8 and fp32) and its dense
  weights;
- a run killed between a version's files and its pointer, resumed from an earlier checkpoint on another rank count:
  the incomplete staging directory is removed, the next version follows the newest complete one, and its delta makes
  the served state equal the resumed trainer's again;
- a table optimizer that moves rows no batch touched is refused by name before anything is written.

The runs are shared by module-scoped fixtures; the fulls' AOTInductor compiles run in the background of the runs.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec import RecShardStrategy
from lightning_rec.checkpoint import export, load_exported
from lightning_rec.publish import ModelPublisher
from lightning_rec.serving.deltas import artifact_rows, read_delta, read_latest, read_manifest
from tests.helpers import zoo_dlrm
from tests.helpers.dist import launch, run_ranks
from tests.helpers.zoo import share_rows

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


# ---- scenarios (run on each rank) -----------------------------------------------------------------------------------


class _Reference(L.Callback):
    """Saves the trained state (a sharded checkpoint) at every step the publisher publishes, and records each step's
    global batch ids per table (from the rank's batch; the test unions them)."""

    def __init__(self, out: Path, every: int, tables: Mapping[str, str]) -> None:
        self.out, self.every, self.tables = out, every, tables
        self.ids: dict[int, dict[str, list[int]]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        kjt = _kjt_of(batch)
        step_ids: dict[str, list[int]] = {}
        for key in kjt.keys():
            step_ids.setdefault(self.tables[key], []).extend(kjt[key].values().tolist())
        self.ids[trainer.global_step] = step_ids
        if trainer.global_step % self.every == 0 or trainer.global_step == trainer.max_steps:
            trainer.save_checkpoint(self.out / f"step{trainer.global_step}")


def _kjt_of(batch: Any) -> KeyedJaggedTensor:
    if isinstance(batch, Mapping):
        return batch["sparse"]
    return batch.sparse_features


class _KilledBeforePointer(ModelPublisher):
    """Killed (SIGKILL, with its export processes, as an orchestrator kills a job) at a version's pointer: its files
    written, ``kill_at="rename"`` before its directory is renamed into place, ``"pointer"`` after."""

    def __init__(self, *args: Any, kill_version: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kill_version = kill_version

    def _before_pointer(self, version: int) -> None:
        if version == self.kill_version:
            for job in self._exports:
                job.process.kill()
            os.kill(os.getpid(), signal.SIGKILL)


def _model(name: str) -> tuple[L.LightningModule, Any, dict[str, str], dict[str, Any]]:
    """The module, its global batches (a function of the step count), feature -> table, export arguments."""
    if name == "dlrm":
        from tests.helpers.zoo import seeded_module

        module = seeded_module(zoo_dlrm.CASE)
        tables = {
            f: c.name
            for c in module.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()
            for f in c.feature_names
        }
        return module, zoo_dlrm.CASE.batches, tables, {}
    from tests.test_serving import TutorialModel, tutorial_batch

    torch.manual_seed(0)
    return (
        TutorialModel(),
        lambda steps: [tutorial_batch(i) for i in range(steps)],
        {"user": "t_user", "item": "t_item", "seen": "t_item"},
        {"num_dense_features": 3},
    )


def publish_run(
    rank: int,
    world_size: int,
    out_dir: Path,
    model: str,
    steps: int,
    every: int,
    full_every: int,
    keep: int,
    table_dtype: str,
    kill_version: int | None = None,
    checkpoint_every: int | None = None,
    resume_from: str | None = None,
    first_step: int = 0,
) -> dict[str, Any]:
    """Train ``model`` for ``steps`` global batches (this rank's share) with a publisher into ``out_dir/pub``, the
    reference states into ``out_dir/ref`` and, with ``checkpoint_every``, Lightning checkpoints into ``out_dir/ckpt``."""
    L.seed_everything(0, verbose=False)
    module, batches, tables, export_args = _model(model)
    constraints = zoo_dlrm.CASE.constraints[world_size] if model == "dlrm" else None
    kwargs = {"every_n_steps": every, "full_every": full_every, "keep": keep, "table_dtype": table_dtype}
    if kill_version is not None:
        publisher: ModelPublisher = _KilledBeforePointer(
            out_dir / "pub", **kwargs, export_args=export_args, kill_version=kill_version
        )
    else:
        publisher = ModelPublisher(out_dir / "pub", **kwargs, export_args=export_args)
    reference = _Reference(out_dir / "ref" / f"run{first_step}", every, tables)
    callbacks: list[Any] = [publisher, reference]
    if checkpoint_every:
        callbacks.append(
            ModelCheckpoint(out_dir / "ckpt", "{step}", every_n_train_steps=checkpoint_every, save_top_k=-1)
        )
    trainer = L.Trainer(
        strategy=RecShardStrategy(constraints=constraints),
        accelerator="cpu",
        devices=world_size,
        max_steps=steps,
        enable_checkpointing=bool(checkpoint_every),
        callbacks=callbacks,
        **QUIET,
    )
    data = [share_rows(b, rank, world_size) for b in batches(steps)]
    trainer.fit(module, DataLoader(data, batch_size=None, collate_fn=lambda b: b), ckpt_path=resume_from)
    return {"ids": reference.ids, "version": publisher.version}


# ---- checks (in the test's process) --------------------------------------------------------------------------------

_TABLE = "embedding_bags."


def _reference_state(folder: Path, step: int, cache: dict[Any, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The unsharded trained state at ``step`` (a reference checkpoint of the run in ``folder``)."""
    key = (folder, step)
    if key not in cache:
        export(folder / f"step{step}", folder / f"step{step}.pt")
        cache[key] = load_exported(folder / f"step{step}.pt")
    return cache[key]


def _split(state: Mapping[str, torch.Tensor], table_dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tables, dense)``: every table's rows as the artifact holds them (``artifact_rows`` of the whole table),
    by table name; the other entries by key."""
    tables, dense = {}, {}
    for key, value in state.items():
        if _TABLE in key and key.endswith(".weight"):
            tables[key.split(_TABLE)[1][: -len(".weight")]] = artifact_rows(value.float(), table_dtype)
        else:
            dense[key] = value
    return tables, dense


def _apply(served: tuple[dict[str, torch.Tensor], dict[str, Any]], root: Path, version: int) -> None:
    """What a server does with a delta: each table's rows replaced at their ids, each dense tensor replaced."""
    delta = read_delta(root, version)
    for table, (ids, rows) in delta.tables.items():
        served[0][table][ids] = rows
    served[1].update(delta.dense)


def _assert_same(served: tuple[dict[str, torch.Tensor], dict[str, Any]], expected: tuple[dict, dict], what: str):
    for table, rows in expected[0].items():
        differ = (served[0][table] != rows).any(dim=1).nonzero().flatten().tolist()
        assert not differ, f"{what}: table {table!r} rows {differ[:10]} differ from a full export of the same step"
    assert served[1].keys() == expected[1].keys(), what
    for key, value in expected[1].items():
        assert torch.equal(served[1][key], value), f"{what}: dense {key!r} differs"


def _chain_equals_training(root: Path, ref: Path, first: int, last: int, table_dtype: str) -> None:
    """Start from the trained state at version ``first``'s step, apply the deltas after it one by one: after each,
    the served bytes equal those of the trained state at that version's step (``ref``: reference checkpoints)."""
    cache: dict[Any, dict[str, torch.Tensor]] = {}
    step = read_manifest(root / "versions" / f"v{first:06d}" / "manifest.json").step
    tables, dense = _split(_reference_state(ref, step, cache), table_dtype)
    served = ({t: r.clone() for t, r in tables.items()}, dict(dense))
    for version in range(first + 1, last + 1):
        _apply(served, root, version)
        step = read_delta(root, version).manifest.step
        _assert_same(served, _split(_reference_state(ref, step, cache), table_dtype), f"version {version}")


def _touched(results: list[dict[str, Any]], steps: range) -> dict[str, set[int]]:
    """The table rows the global batches of ``steps`` touched (every rank's share)."""
    out: dict[str, set[int]] = {}
    for result in results:
        for step in steps:
            for table, ids in result["ids"].get(str(step), {}).items():
                out.setdefault(table, set()).update(ids)
    return out


# ---- 2 ranks: DLRM-DCNv2 on MovieLens, int8 -----------------------------------------------------------------------

STEPS, EVERY = 8, 2


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """8 steps on 2 ranks, a version every 2 (1..4), a full every 2 versions (1 and 3), keep=2."""
    out = tmp_path_factory.mktemp("publish2")
    results = run_ranks(
        publish_run,
        2,
        out,
        timeout=600,
        model="dlrm",
        steps=STEPS,
        every=EVERY,
        full_every=2,
        keep=2,
        table_dtype="int8",
    )
    return out, results


@pytest.mark.dist
def test_two_ranks_write_versions_manifests_pointer_and_keep_the_chain(two_ranks):
    out, results = two_ranks
    root = out / "pub"
    assert [r["version"] for r in results] == [4, 4]
    assert read_latest(root) == 4
    # keep=2: versions 3 and 4; the newest full <= LATEST (3) and its chain stay; version 1, 2 and full 1 are gone
    assert sorted(p.name for p in (root / "versions").iterdir()) == ["v000003", "v000004"]
    assert sorted(p.name for p in (root / "full").glob("*.pt2")) == ["v000003.pt2"]
    assert not (root / "checkpoints").exists()  # the fulls' checkpoints are removed once exported
    full = read_manifest(root / "full" / "v000003.json")
    assert (full.kind, full.version, full.step, full.world_size, full.table_dtype) == ("full", 3, 6, 2, "int8")
    for version, step in ((3, 6), (4, 8)):
        delta = read_delta(root, version)  # checks every file's size and SHA-256 against the manifest
        m = delta.manifest
        assert (m.kind, m.previous, m.step, m.world_size) == ("delta", version - 1, step, 2)
        assert sorted(m.files) == ["delta.r0.pt", "delta.r1.pt"]


@pytest.mark.dist
def test_two_ranks_deltas_hold_exactly_the_rows_touched_since_the_previous_version(two_ranks):
    out, results = two_ranks
    for version in (3, 4):
        delta = read_delta(out / "pub", version)
        step = delta.manifest.step
        expected = _touched(results, range(step - EVERY + 1, step + 1))
        found = {t: ids.tolist() for t, (ids, _) in delta.tables.items()}
        assert {t: sorted(v) for t, v in found.items()} == {t: sorted(v) for t, v in expected.items()}
        assert all(len(v) == len(set(v)) for v in found.values()), "a row in two parts"


@pytest.mark.dist
def test_two_ranks_full_plus_deltas_is_the_trained_model_bit_for_bit(two_ranks):
    out, _ = two_ranks
    _chain_equals_training(out / "pub", out / "ref" / "run0", 3, 4, "int8")
