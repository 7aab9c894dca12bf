"""Sharded checkpoints: exact resume, resharding across world sizes and plans, export, and safety."""

from __future__ import annotations

import ast
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_rec import _cli as cli
from lightning_rec.checkpoint import (
    CheckpointError,
    UnsafeCheckpointError,
    export,
    is_checkpoint,
    load_exported,
)
from lightning_rec.checkpoint import _layout as layout
from tests.helpers import checkpoint_scenarios
from tests.helpers.checkpoint_scenarios import fixed_batch
from tests.helpers.dist import run_ranks
from tests.helpers.models import RecModel, local_weights, saved_weights
from tests.helpers.scenarios import make_loader, make_trainer

THREE_PLANS = ["table_wise", "column_wise", "data_parallel"]


@pytest.mark.dist
def test_exact_resume_on_two_processes(tmp_path):
    """N epochs straight == k epochs, a new job, resume to N: same per-step losses and final weights."""
    straight = run_ranks(checkpoint_scenarios.fit_epochs, 2, tmp_path / "straight", tag="w", epochs=3)
    first = run_ranks(checkpoint_scenarios.fit_epochs, 2, tmp_path / "split", tag="first", epochs=1)
    last = Path(first[0]["last"])
    assert last.name == "last.ckpt" and is_checkpoint(last)
    resumed = run_ranks(
        checkpoint_scenarios.fit_epochs, 2, tmp_path / "split", tag="resumed", epochs=3, ckpt_path=str(last)
    )

    for rank in range(2):
        n_first = len(first[rank]["losses"])
        assert n_first == 4
        assert first[rank]["losses"] == pytest.approx(straight[rank]["losses"][:n_first], abs=1e-6)
        assert resumed[rank]["losses"] == pytest.approx(straight[rank]["losses"][n_first:], abs=1e-6)
        # fused (Adagrad accumulators of CW/TW tables), data-parallel table and dense optimizer state all came back
        assert resumed[rank]["restored_sums"] == pytest.approx(first[rank]["final_sums"], rel=1e-6)
        assert len(resumed[rank]["restored_sums"]) == 7 and all(v > 0 for v in resumed[rank]["restored_sums"].values())
        # the scheduler's decayed rate, for the dense groups and the fused tables that follow it
        lrs = resumed[rank]["restored_lrs"]  # dense group, then the fused kernel groups this rank holds
        assert len(lrs) >= 3 and lrs == pytest.approx([0.1 * 0.9**4] * len(lrs))
    a, b = saved_weights(tmp_path / "straight", "w", 2), saved_weights(tmp_path / "split", "resumed", 2)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)
    # ModelCheckpoint(every_n_epochs=1, save_top_k=-1, save_last=True) wrote complete checkpoint directories
    names = sorted(p.name for p in (tmp_path / "split" / "ckpts").iterdir())
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"]
    assert all(is_checkpoint(tmp_path / "split" / "ckpts" / n) for n in names)


@pytest.mark.dist
def test_reshard_across_world_sizes_and_plans_and_export(tmp_path):
    """2 ranks -> 1 and 2, 1 rank -> 1 and 2, each onto table-wise, column-wise and data-parallel plans: identical
    predictions on a fixed batch; fit resumes across plans with the optimizer state; export matches too."""
    two = run_ranks(checkpoint_scenarios.reshard, 2, tmp_path, save_plan="mixed", load_plans=THREE_PLANS)
    one = run_ranks(checkpoint_scenarios.reshard, 1, tmp_path, save_plan="column_wise", load_plans=THREE_PLANS)
    two_again = run_ranks(checkpoint_scenarios.reshard, 2, tmp_path, save_plan=None, load_plans=THREE_PLANS)
    expected = {"saved_2.ckpt": torch.tensor(two[0]["saved"]), "saved_1.ckpt": torch.tensor(one[0]["saved"])}
    assert not torch.allclose(expected["saved_1.ckpt"], expected["saved_2.ckpt"])  # two different models
    checked = 0
    for result in two + one + two_again:
        for key, predictions in result["loaded"].items():
            torch.testing.assert_close(
                torch.tensor(predictions), expected[key.split(":")[0]], rtol=0, atol=1e-6, msg=key
            )
            checked += 1
    assert checked == 2 * 3 + 2 * 3 + 2 * 2 * 3

    # Resume fitting on 1 rank from the 2-rank mixed-plan checkpoint under three other plans: the optimizer state
    # (fused accumulators <-> the data-parallel table's torch Adagrad) arrives intact, so training is identical.
    resumed = run_ranks(
        checkpoint_scenarios.resume_on_plans,
        1,
        tmp_path / "resume",
        ckpt=str(tmp_path / "saved_2.ckpt"),
        plans=THREE_PLANS,
    )[0]
    for plan in THREE_PLANS:
        assert resumed[plan]["restored_sums"] == pytest.approx(two[0]["saved_sums"], rel=1e-6), plan
        assert resumed[plan]["losses"] == pytest.approx(resumed["table_wise"]["losses"], abs=1e-6), plan
        assert resumed[plan]["global_step"] == 6

    # A mismatching model on 2 ranks: both ranks raise the same complete error (and nobody hangs).
    errors = [
        r["error"]
        for r in run_ranks(
            checkpoint_scenarios.load_mismatching, 2, tmp_path / "bad", ckpt=str(tmp_path / "saved_2.ckpt")
        )
    ]
    assert (
        errors[0] == errors[1] and "t_genre.weight: shape (12, 8) in the checkpoint, (13, 8) in the model" in errors[0]
    )

    # Export: one file per format, loaded into the plain, unsharded model (tables on meta) on this process.
    for name in ("model.safetensors", "model.pt"):
        shapes = export(tmp_path / "saved_2.ckpt", tmp_path / name)
        assert shapes["ebc.embedding_bags.t_user.weight"] == (60, 8)
        plain = RecModel()
        missing, unexpected = plain.load_state_dict(load_exported(tmp_path / name), assign=True)
        assert not missing and not unexpected
        with torch.no_grad():
            predictions = torch.sigmoid(plain(fixed_batch()))
        torch.testing.assert_close(predictions, expected["saved_2.ckpt"], rtol=0, atol=1e-6, msg=name)
    assert (
        torch.load(tmp_path / "model.pt", weights_only=True).keys()
        == load_exported(tmp_path / "model.safetensors").keys()
    )


def test_export_command_selects_a_submodule(tmp_path, capsys):
    trainer = make_trainer(1, 2)
    model = RecModel()
    trainer.fit(model, make_loader(0, 2, 8, {}))
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    cli.run(["export", str(tmp_path / "c.ckpt"), str(tmp_path / "ebc.pt"), "--prefix", "ebc."])
    assert "wrote" in capsys.readouterr().out
    state = torch.load(tmp_path / "ebc.pt", weights_only=True)
    assert sorted(state) == [
        "embedding_bags.t_genre.weight",
        "embedding_bags.t_item.weight",
        "embedding_bags.t_user.weight",
    ]
    with pytest.raises(CheckpointError, match="no model weights under prefix 'nope.'"):
        export(tmp_path / "c.ckpt", tmp_path / "x.pt", prefix="nope.")
    assert not (tmp_path / "x.pt").exists()


# ---------------------------------------------------------------------------------------------------------
# Safety, on one process
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    """A fitted model, its trainer, and a checkpoint of it."""
    trainer = make_trainer(1, 3)
    model = RecModel()
    trainer.fit(model, make_loader(0, 3, 8, {}))
    path = tmp_path / "ckpt" / "model.ckpt"
    trainer.save_checkpoint(path)
    return trainer, model, path


def _snapshot(model):
    return {k: [t.clone() for _, t in v] for k, v in local_weights(model).items()}


def _assert_unchanged(model, before):
    after = _snapshot(model)
    for k in before:
        for x, y in zip(before[k], after[k]):
            assert torch.equal(x, y), f"{k} was modified"


def _fresh_trainer_and_model(**model_kwargs):
    trainer = make_trainer(1, 6)
    model = RecModel(**model_kwargs)
    return trainer, model


def test_layout_and_contents(saved):
    _, _, path = saved
    files = {p.name for p in path.iterdir()}
    data = {f for f in files if f.endswith(".distcp")}
    assert files - data == {".metadata", "COMPLETE", "meta.pt"}
    assert len(data) > 1 and all(f.startswith("__0_") for f in data)  # one file per tensor chunk, all rank 0's
    manifest = layout.read_manifest(path)
    assert set(manifest["files"]) == files - {"COMPLETE"} and manifest["world_size"] == 1
    from lightning_rec.checkpoint._safe_io import load_meta, read_metadata

    meta = load_meta(path / "meta.pt")
    assert meta["global_step"] == 3 and meta["loops"] and "lr_schedulers" in meta
    assert meta["lightning_rec"]["embedding_optimizer"]["name"] == "adagrad"
    assert {t["name"]: t["sharding_type"] for t in meta["lightning_rec"]["plan"]["tables"]} == {
        "t_user": "column_wise",
        "t_item": "table_wise",
        "t_genre": "data_parallel",
    }
    keys = set(read_metadata(path).state_dict_metadata)
    assert "model/ebc.embedding_bags.t_user.weight" in keys
    assert "optim/0/ebc.embedding_bags.t_user.weight/momentum1" in keys  # fused Adagrad accumulator
    assert "optim/0/ebc.embedding_bags.t_genre.weight/momentum1" in keys  # the data-parallel table's, same name
    assert "optim/0/mlp.0.weight/sum" in keys and "optim/0/mlp.0.weight/step" in keys
    assert not any(p.name.startswith(".model.ckpt") for p in path.parent.iterdir())  # no staging left behind


def test_crash_mid_save_leaves_the_previous_checkpoint(saved, monkeypatch):
    trainer, model, path = saved
    before = layout.read_manifest(path)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(layout, "mark_complete", crash)
    with pytest.raises(CheckpointError, match="rank 0: OSError: disk full"):
        trainer.save_checkpoint(path)  # overwrite: the old checkpoint must survive
    with pytest.raises(CheckpointError, match=r"Saving checkpoint .*new.ckpt' failed"):
        trainer.save_checkpoint(path.parent / "new.ckpt")
    assert layout.read_manifest(path) == before
    assert not (path.parent / "new.ckpt").exists()
    assert not (path.parent / layout.WORK_DIR).exists(), "a failed save removes its staging directory"
    monkeypatch.undo()
    # A crash (kill -9) mid-save leaves the staging directory; the next save to that name clears it.
    layout.staging_path(path.parent / "new.ckpt").mkdir(parents=True)
    trainer.save_checkpoint(path.parent / "new.ckpt")
    assert is_checkpoint(path.parent / "new.ckpt") and not (path.parent / layout.WORK_DIR).exists()


def test_incomplete_truncated_and_corrupt_checkpoints_fail_before_any_change(saved, tmp_path):
    _, _, path = saved
    trainer, model = _fresh_trainer_and_model()
    trainer.fit(model, make_loader(0, 1, 8, {}))
    before = _snapshot(model)

    bad = tmp_path / "bad.ckpt"
    shutil.copytree(path, bad)
    (bad / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        trainer.validate(model, make_loader(0, 1, 8, {}), ckpt_path=bad)

    shutil.rmtree(bad)
    shutil.copytree(path, bad)
    data = bad / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])  # truncated
    with open(bad / "meta.pt", "r+b") as f:  # and one flipped byte, same size
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError) as err:
        trainer.validate(model, make_loader(0, 1, 8, {}), ckpt_path=bad)
    message = str(err.value)
    assert "__0_0.distcp" in message and "truncated" in message
    assert "meta.pt" in message and "SHA-256" in message and "nothing was modified" in message
    _assert_unchanged(model, before)


def test_mismatching_model_lists_every_problem_before_any_change(saved):
    _, _, path = saved
    trainer, model = _fresh_trainer_and_model()
    # Same names, other shapes: a wider MLP input. And one table too many in the model.
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from tests.helpers.models import tables

    model.ebc = EmbeddingBagCollection(
        tables=[
            *tables()[:2],
            EmbeddingBagConfig(name="t_genre", embedding_dim=8, num_embeddings=13, feature_names=["genre"]),
            EmbeddingBagConfig(name="t_extra", embedding_dim=8, num_embeddings=5, feature_names=["extra"]),
        ],
        device=torch.device("meta"),
    )
    model.mlp[0] = torch.nn.Linear(34, 16)
    trainer.fit(model, [])  # shards it (no steps)
    before = _snapshot(model)
    with pytest.raises(CheckpointError) as err:
        trainer.validate(model, [], ckpt_path=path)
    message = str(err.value)
    assert "ebc.embedding_bags.t_genre.weight: shape (12, 8) in the checkpoint, (13, 8) in the model" in message
    assert "ebc.embedding_bags.t_extra.weight: in the model, missing from the checkpoint" in message
    assert "mlp.0.weight: shape (16, 26) in the checkpoint, (16, 34) in the model" in message
    _assert_unchanged(model, before)


def test_weights_only_checkpoint_cannot_resume_but_can_predict(tmp_path):
    trainer = make_trainer(1, 2)
    model = RecModel()
    trainer.fit(model, make_loader(0, 2, 8, {}))
    trainer.save_checkpoint(tmp_path / "w.ckpt", weights_only=True)
    expected = trainer.predict(model, DataLoader([fixed_batch()], batch_size=None))[0]

    trainer2, model2 = _fresh_trainer_and_model()
    predictions = trainer2.predict(model2, DataLoader([fixed_batch()], batch_size=None), ckpt_path=tmp_path / "w.ckpt")[
        0
    ]
    torch.testing.assert_close(predictions, expected, rtol=0, atol=1e-6)
    trainer3, model3 = _fresh_trainer_and_model()
    with pytest.raises(CheckpointError, match="no optimizer state"):
        trainer3.fit(model3, make_loader(0, 4, 8, {}), ckpt_path=tmp_path / "w.ckpt")


def test_loading_never_unpickles_arbitrary_objects(saved, tmp_path):
    _, _, path = saved
    trainer, model = _fresh_trainer_and_model()
    trainer.fit(model, [])
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for victim in (".metadata", "meta.pt"):
        bad = tmp_path / f"evil{victim}.ckpt"
        shutil.copytree(path, bad)
        if victim == ".metadata":
            (bad / victim).write_bytes(pickle.dumps(Evil()))
        else:
            torch.save({"payload": Evil()}, bad / victim)
        # re-seal the manifest so only the unpickling guards stand between the file and the loader
        manifest = layout.read_manifest(bad)
        files = {n: layout.file_digest(bad / n) for n in manifest["files"]}
        (bad / "COMPLETE").unlink()
        layout.mark_complete(bad, files, {"world_size": 1})
        with pytest.raises(UnsafeCheckpointError):
            trainer.validate(model, [], ckpt_path=bad)
        assert not marker.exists()


def test_model_checkpoint_top_k_pruning_and_last(tmp_path):
    """save_top_k + every_n_train_steps + save_last: pruned directories are gone, the best and the newest remain,
    `last` is complete and loads; `ckpt_path="last"` resumes from it."""
    callback = ModelCheckpoint(
        dirpath=tmp_path / "ck", monitor="train_loss", mode="max", save_top_k=2, every_n_train_steps=2, save_last="link"
    )
    trainer = make_trainer(1, 8, callbacks=[callback])
    trainer.fit(RecModel(), make_loader(0, 8, 8, {}))
    entries = {p.name: p for p in (tmp_path / "ck").iterdir()}
    assert len([n for n in entries if n.startswith("epoch")]) == 2
    assert entries["last.ckpt"].is_symlink() and is_checkpoint(entries["last.ckpt"])
    kept = sorted((n for n in entries if n.startswith("epoch")), key=lambda n: int(n.split("step=")[1].split(".")[0]))
    assert os.path.realpath(entries["last.ckpt"]) == os.path.realpath(entries[kept[-1]])  # the newest saved one
    assert all(is_checkpoint(p) for p in entries.values()) and not any(n.startswith(".") for n in entries)
    resumed = make_trainer(1, 10, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck")])
    resumed.fit(RecModel(), make_loader(0, 10, 8, {}), ckpt_path="last")
    assert resumed.global_step == 10


def test_checkpoint_never_imports_the_strategy():
    """The layers run one way: the strategy saves and loads through ``checkpoint/``, which works on what it is handed
    (its own ``ComposedOptimizer`` interface, a ``ShardingRecord``) and imports nothing of ``_strategy``."""
    package = Path(__file__).resolve().parents[2] / "lightning_rec" / "checkpoint"
    imports = {
        (file.name, name)
        for file in package.glob("*.py")
        for node in ast.walk(ast.parse(file.read_text()))
        for name in (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
    }
    assert {name for _, name in imports} >= {"lightning_rec.checkpoint._optimizer_state"}  # the walk sees imports
    assert not [
        (file, name) for file, name in imports if name.startswith(("lightning_rec._strategy", "lightning_rec._inputs"))
    ]
