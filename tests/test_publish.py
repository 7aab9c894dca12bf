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
import shutil
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

from lightning_rec import EmbeddingOptimizer, RecShardStrategy
from lightning_rec.checkpoint import export, load_exported
from lightning_rec.publish import ModelPublisher
from lightning_rec.serving import FreshModel, export_inference, load_pt2, serving_inputs
from lightning_rec.serving.deltas import artifact_rows, read_delta, read_latest, read_manifest
from tests.helpers import zoo_dlrm
from tests.helpers.dist import launch, run_ranks
from tests.helpers.zoo import share_rows

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


# ---- scenarios (run on each rank) -----------------------------------------------------------------------------------


class _Reference(L.Callback):
    """Saves the trained state (a sharded checkpoint) at every step the publisher publishes, and each step's table
    ids of this rank's batch (``ids/step<N>.rank<R>.json``: a preempted rank returns no result)."""

    def __init__(self, out: Path, every: int, tables: Mapping[str, str]) -> None:
        self.out, self.every, self.tables = out, every, tables

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        kjt = _kjt_of(batch)
        ids: dict[str, list[int]] = {}
        for key in kjt.keys():
            ids.setdefault(self.tables[key], []).extend(kjt[key].values().tolist())
        (self.out / "ids").mkdir(parents=True, exist_ok=True)
        (self.out / "ids" / f"step{trainer.global_step}.rank{trainer.global_rank}.json").write_text(json.dumps(ids))
        if trainer.global_step % self.every == 0 or trainer.global_step == trainer.max_steps:
            trainer.save_checkpoint(self.out / f"step{trainer.global_step}")


def _kjt_of(batch: Any) -> KeyedJaggedTensor:
    if isinstance(batch, Mapping):
        return batch["sparse"]
    return batch.sparse_features


class _Killed(ModelPublisher):
    """Sends ``sig`` to its own process on rank 0 at version ``kill_version``'s ``stage`` (see
    ``ModelPublisher._before_pointer``): ``"files"`` (every file written, the directory not renamed into place) or
    ``"renamed"`` (the version complete, ``LATEST`` not moved yet). A SIGKILL takes the export processes along, as an
    orchestrator killing the job does."""

    def __init__(self, *args: Any, kill: tuple[int, str, int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kill = kill

    def _before_pointer(self, version: int, stage: str) -> None:
        kill_version, kill_stage, sig = self.kill
        if (version, stage) == (kill_version, kill_stage):
            if sig == signal.SIGKILL:
                for job in self._exports:
                    job.stop()
            os.kill(os.getpid(), sig)


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
    label: str = "run",
    kill: tuple[int, str, int] | None = None,
    checkpoint_every: int | None = None,
    resume_from: str | None = None,
    root: str | None = None,
) -> dict[str, Any]:
    """Train ``model`` for ``steps`` global batches (this rank's share) with a publisher into ``out_dir/pub``, the
    reference states into ``out_dir/ref/<label>`` and, with ``checkpoint_every``, Lightning checkpoints into
    ``out_dir/ckpt`` (``root`` instead of ``out_dir``: runs that continue one another)."""
    base = Path(root) if root else out_dir
    L.seed_everything(0, verbose=False)
    module, batches, tables, export_args = _model(model)
    constraints = None
    if model == "dlrm":  # the user table in two column blocks of 4 (TorchRec's default block, 128, keeps it whole)
        constraints = {**zoo_dlrm.CASE.constraints[world_size]}
        constraints["t_user_id"] = {"sharding_types": ["column_wise"], "min_partition": 4}
    kwargs = {"every_n_steps": every, "full_every": full_every, "keep": keep, "table_dtype": table_dtype}
    publisher = (
        _Killed(base / "pub", **kwargs, export_args=export_args, kill=tuple(kill))
        if kill
        else ModelPublisher(base / "pub", **kwargs, export_args=export_args)
    )
    reference = _Reference(base / "ref" / label, every, tables)
    callbacks: list[Any] = [reference, publisher]  # the reference first: a kill in the publisher comes after it
    if checkpoint_every:
        callbacks.append(ModelCheckpoint(base / "ckpt", "{step}", every_n_train_steps=checkpoint_every, save_top_k=-1))
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
    return {"version": publisher.version}


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


def _chain_equals_training(root: Path, references: Mapping[int, Path], first: int, last: int, dtype: str) -> None:
    """Start from the trained state at version ``first``'s step, apply the deltas after it one by one: after each,
    the served bytes equal those of the trained state at that version's step (``references``: version -> the
    reference checkpoints of the run that wrote it)."""
    cache: dict[Any, dict[str, torch.Tensor]] = {}
    step = read_manifest(root / "versions" / f"v{first:06d}" / "manifest.json").step
    tables, dense = _split(_reference_state(references[first], step, cache), dtype)
    served = ({t: r.clone() for t, r in tables.items()}, dict(dense))
    for version in range(first + 1, last + 1):
        _apply(served, root, version)
        step = read_delta(root, version).manifest.step
        _assert_same(served, _split(_reference_state(references[version], step, cache), dtype), f"version {version}")


def _touched(ref: Path, steps: range) -> dict[str, set[int]]:
    """The table rows the batches of ``steps`` touched, on every rank (as the run's ``_Reference`` recorded them)."""
    out: dict[str, set[int]] = {}
    for step in steps:
        for record in (ref / "ids").glob(f"step{step}.rank*.json"):
            for table, ids in json.loads(record.read_text()).items():
                out.setdefault(table, set()).update(ids)
    return out


# ---- 2 ranks: DLRM-DCNv2 on MovieLens, int8 -----------------------------------------------------------------------

STEPS, EVERY = 8, 2


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """8 steps on 2 ranks, a version every 2 (1..4), a full every 3 versions (1 and 4)."""
    out = tmp_path_factory.mktemp("publish2")
    results = run_ranks(
        publish_run,
        2,
        out,
        timeout=600,
        model="dlrm",
        steps=STEPS,
        every=EVERY,
        full_every=3,
        keep=10,
        table_dtype="int8",
    )
    return out, results


@pytest.mark.dist
def test_two_ranks_write_versions_manifests_fulls_and_the_pointer(two_ranks):
    out, results = two_ranks
    root = out / "pub"
    assert [r["version"] for r in results] == [4, 4]
    assert read_latest(root) == 4
    assert sorted(p.name for p in (root / "versions").iterdir()) == [f"v{v:06d}" for v in range(1, 5)]
    assert sorted(p.name for p in (root / "full").iterdir()) == [
        "v000001.json",
        "v000001.pt2",
        "v000004.json",
        "v000004.pt2",
    ]
    assert not (root / "checkpoints").exists()  # the fulls' checkpoints are removed once exported
    for version, step in ((1, 2), (4, 8)):
        full = read_manifest(root / "full" / f"v{version:06d}.json")
        assert (full.kind, full.version, full.step, full.world_size, full.table_dtype) == (
            "full",
            version,
            step,
            2,
            "int8",
        )
        assert list(full.files) == [f"v{version:06d}.pt2"]
    for version in range(1, 5):
        delta = read_delta(root, version)  # checks every file's size and SHA-256 against the manifest
        m = delta.manifest
        assert (m.kind, m.previous, m.step, m.world_size) == ("delta", version - 1 or None, 2 * version, 2)
        assert sorted(m.files) == ["delta.r0.pt", "delta.r1.pt"]


@pytest.mark.dist
def test_two_ranks_deltas_hold_exactly_the_rows_touched_since_the_previous_version(two_ranks):
    out, results = two_ranks
    for version in range(2, 5):
        delta = read_delta(out / "pub", version)
        step = delta.manifest.step
        expected = _touched(out / "ref" / "run", range(step - EVERY + 1, step + 1))
        found = {t: ids.tolist() for t, (ids, _) in delta.tables.items()}
        assert {t: sorted(v) for t, v in found.items()} == {t: sorted(v) for t, v in expected.items()}
        assert all(len(v) == len(set(v)) for v in found.values()), "a row in two parts"


@pytest.mark.dist
def test_two_ranks_full_plus_deltas_is_the_trained_model_bit_for_bit(two_ranks):
    out, _ = two_ranks
    _chain_equals_training(out / "pub", dict.fromkeys(range(1, 5), out / "ref" / "run"), 1, 4, "int8")


def _served_answers_as(root: Path, full: Path, version: int, probes: Any) -> None:
    """A server following ``root`` (its newest full at or before ``LATEST``, then the deltas after it) serves
    ``version`` and answers ``probes`` exactly as the package ``full`` (a full export of that version's step)."""
    served, reference = FreshModel(root), load_pt2(full)
    assert served.version == version
    sparse, dense = probes
    inputs = serving_inputs(reference.spec, sparse, dense)
    assert torch.equal(served(*inputs), reference(*inputs))


@pytest.mark.dist
def test_two_ranks_full_1_and_deltas_2_to_4_answer_1000_probes_as_full_4(two_ranks, tmp_path):
    out, _ = two_ranks
    # The directory as a server saw it before full 4 was out: full 1, then deltas 2, 3, 4
    shutil.copytree(out / "pub", tmp_path / "pub", ignore=shutil.ignore_patterns("v000004.*"))
    probes = zoo_dlrm.movielens()[0][torch.arange(5000, 6000)]  # rows no step trained on
    probe = (probes.sparse_features, probes.dense_features)
    _served_answers_as(tmp_path / "pub", out / "pub" / "full" / "v000004.pt2", 4, probe)


# ---- killed between a version's files and its pointer, resumed on another rank count -------------------------------


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """The tutorial model (a table two features share), fp32, a version every 2 steps, checkpoints every 2:

    A. 1 rank, SIGKILL at version 3 (step 6) once its directory is in place, before ``LATEST`` moves;
    B. 2 ranks from A's checkpoint of step 4 (version 2), SIGTERM to rank 0 at version 5 (step 8) before its
       directory is renamed into place (the strategy's preemption ends the step, saves a checkpoint, exits 143);
    C. 1 rank from B's preemption checkpoint, to step 12.
    """
    out = tmp_path_factory.mktemp("killed")
    common = {"model": "tutorial", "every": 2, "full_every": 100, "keep": 3, "table_dtype": "fp32", "root": str(out)}
    runs: dict[str, Any] = {}
    runs["A"] = launch(
        publish_run,
        1,
        out / "A",
        timeout=300,
        steps=12,
        label="A",
        checkpoint_every=2,
        kill=(3, "renamed", signal.SIGKILL),
        **common,
    )
    runs["after A"] = (read_latest(out / "pub"), sorted(p.name for p in (out / "pub" / "versions").iterdir()))
    step4 = next((out / "ckpt").glob("step=4*"))
    runs["B"] = launch(
        publish_run,
        2,
        out / "B",
        timeout=300,
        steps=12,
        label="B",
        checkpoint_every=2,
        kill=(5, "files", signal.SIGTERM),
        resume_from=str(step4),
        **common,
    )
    runs["after B"] = (read_latest(out / "pub"), sorted(p.name for p in (out / "pub" / "versions").iterdir()))
    preempted = next((out / "B").glob("hpc_ckpt_*"))
    runs["C"] = run_ranks(
        publish_run, 1, out / "C", timeout=300, steps=12, label="C", resume_from=str(preempted), **common
    )
    return out, runs


@pytest.mark.dist
def test_killed_between_files_and_pointer_then_resumed_on_another_rank_count(killed_and_resumed):
    out, runs = killed_and_resumed
    root = out / "pub"
    a, b = runs["A"], runs["B"]
    assert a.processes[0].returncode == -signal.SIGKILL, a.log("rank0")[-3000:]
    latest_a, versions_a = runs["after A"]
    assert versions_a == ["v000001", "v000002", "v000003"]  # version 3 complete, its pointer never written
    assert latest_a in (None, 1, 2), latest_a  # None: the first full's export was killed with the job
    assert [p.returncode for p in b.processes] == [143, 143], b.log("rank0")[-3000:]
    latest_b, versions_b = runs["after B"]
    assert versions_b[-1] == "v000005" and latest_b in (None, 5)  # SIGTERM: the publish ended, then the checkpoint
    # No gap, no repeat: 1, 2 (A), 3 (A, killed before its pointer), 4, 5 (B, 2 ranks), 6, 7 (C); keep=3 deletes
    # none of them: the only full is version 1's, and a server starting now needs it and every delta after it
    versions = sorted(p.name for p in (root / "versions").iterdir())
    assert versions == [f"v{v:06d}" for v in range(1, 8)], versions
    steps = [read_delta(root, v).manifest.step for v in range(1, 8)]
    sizes = [read_delta(root, v).manifest.world_size for v in range(1, 8)]
    assert (steps, sizes) == ([2, 4, 6, 6, 8, 10, 12], [1, 1, 1, 2, 2, 1, 1])
    assert read_latest(root) == 7 and read_manifest(root / "full" / "v000001.json").step == 2
    # Version 4 (B resumed from version 2's step) carries what version 3 changed: a server may hold it
    v3 = {t: set(ids.tolist()) for t, (ids, _) in read_delta(root, 3).tables.items()}
    expected = _touched(out / "ref" / "B", range(5, 7))
    for table, ids in v3.items():
        expected.setdefault(table, set()).update(ids)
    assert {t: set(ids.tolist()) for t, (ids, _) in read_delta(root, 4).tables.items()} == expected
    references = {1: "A", 2: "A", 3: "A", 4: "B", 5: "B", 6: "C", 7: "C"}
    _chain_equals_training(root, {v: out / "ref" / r for v, r in references.items()}, 1, 7, "fp32")


# ---- refusals and the directory's rules (fast) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, "every_n_steps must be an integer >= 1, got 0"),
        ({"full_every": 1.5}, "full_every must be an integer >= 1, got 1.5"),
        ({"keep": True}, "keep must be an integer >= 1, got True"),
        ({"table_dtype": "int3"}, "ModelPublisher: table_dtype 'int3' is not one of"),
        ({"export_args": {"format": "torchscript"}}, "export_args cannot set ['format']"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as caught:
        ModelPublisher(tmp_path / "pub", **kwargs)
    assert message in str(caught.value)
    assert not (tmp_path / "pub").exists()


def test_a_table_optimizer_that_moves_untouched_rows_is_refused_before_anything_is_written(tmp_path):
    from tests.helpers.user_models import REORDERING_PLAN, ValuesModel, global_batches, to_batch

    class Decayed(ValuesModel):  # FBGEMM decays only the batch's rows; the data-parallel table's RowWiseAdagrad, all
        def configure_embedding_optimizer(self) -> EmbeddingOptimizer:
            return EmbeddingOptimizer("rowwise_adagrad", lr=0.05, weight_decay=0.01)

    publisher = ModelPublisher(tmp_path / "pub", every_n_steps=1)
    trainer = L.Trainer(
        strategy=RecShardStrategy(constraints=REORDERING_PLAN),
        accelerator="cpu",
        devices=1,
        max_steps=2,
        enable_checkpointing=False,
        callbacks=[publisher],
        default_root_dir=tmp_path,
        **QUIET,
    )
    loader = DataLoader([to_batch(b) for b in global_batches(2, 8)], batch_size=None, collate_fn=lambda b: b)
    with pytest.raises(ValueError) as caught:
        trainer.fit(Decayed(), loader)
    message = str(caught.value)
    assert "table parameter 'ebc.embedding_bags.t_genre.weight' is trained by RowWiseAdagrad" in message
    assert "weight_decay=0.01" in message and "\n" not in message
    assert trainer.global_step == 0 and not (tmp_path / "pub").exists()


def _fake_directory(root: Path, versions: range, fulls: list[int], latest: int | None) -> None:
    """A publish directory's names (empty files): what retention and the pointer read."""
    for v in versions:
        (root / "versions" / f"v{v:06d}").mkdir(parents=True)
        (root / "versions" / f"v{v:06d}" / "manifest.json").write_text("{}")
    (root / "full").mkdir(parents=True, exist_ok=True)
    for f in fulls:
        (root / "full" / f"v{f:06d}.pt2").write_text("")
        (root / "full" / f"v{f:06d}.json").write_text("{}")
    if latest is not None:
        (root / "LATEST").write_text(json.dumps({"version": latest}))


def test_retention_keeps_the_newest_versions_and_never_the_chain_a_server_needs(tmp_path):
    from lightning_rec import _publish_dir as pubdir

    # fulls at 1, 4 and 7 (7's export still running: its version is complete, the full not yet); LATEST = 8
    _fake_directory(tmp_path, range(1, 10), [1, 4], latest=8)
    removed = pubdir.retain(tmp_path, keep=2)
    # the newest full <= LATEST is 4: 4..8 stay (and 9, newer than LATEST), however small keep is
    assert sorted(p.name for p in (tmp_path / "versions").iterdir()) == [f"v{v:06d}" for v in range(4, 10)]
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["v000004.json", "v000004.pt2"]
    assert removed == ["versions/v000001", "versions/v000002", "versions/v000003", "full/v000001.pt2"]


def test_the_pointer_reaches_only_complete_chains_and_a_killed_publish_leaves_nothing_served(tmp_path):
    from lightning_rec import _publish_dir as pubdir

    _fake_directory(tmp_path, range(1, 4), [], latest=None)
    assert pubdir.newest_chain(tmp_path) is None  # no full yet: LATEST waits for the first one
    _fake_directory(tmp_path, range(0), [1], latest=None)
    (tmp_path / "versions" / ".v000004.1a2b").mkdir()  # a staging directory, killed before its rename
    (tmp_path / "versions" / "v000005").mkdir()  # a version directory without its manifest
    (tmp_path / "full" / ".v000004.x.pt2").write_text("")  # a full's export killed before its rename
    (tmp_path / ".LATEST.tmp").write_text("")  # the pointer's temporary file
    assert pubdir.newest_chain(tmp_path) == 3
    removed = pubdir.remove_incomplete(tmp_path)
    assert sorted(removed) == [".LATEST.tmp", "full/.v000004.x.pt2", "versions/.v000004.1a2b", "versions/v000005"]
    assert pubdir.complete_versions(tmp_path) == [1, 2, 3]


@pytest.mark.dist
def test_after_the_kills_the_served_model_answers_1000_probes_as_a_full_export(killed_and_resumed):
    from tests.test_serving import tutorial_batch

    out, _ = killed_and_resumed
    full = out / "step12.pt2"  # a full export of the last step, the state version 7 holds
    export_inference(out / "ref" / "C" / "step12", full, format="pt2", table_dtype="fp32", num_dense_features=3)
    probes = tutorial_batch(1234, rows=1000)
    _served_answers_as(out / "pub", full, 7, (probes["sparse"], probes["dense"]))
