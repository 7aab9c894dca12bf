"""Checkpoints under what a fleet does to them (issue 34, findings 3-6): a reader beside a writer that keeps replacing
``last.ckpt``, a full disk, a read-only directory, a save that died half-way, and ``ckpt_path="last"`` in a run that
was restarted into a new ``version_N`` folder.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_rec import RecShardStrategy
from lightning_rec.checkpoint import CheckpointError, export, is_checkpoint, load_exported
from lightning_rec.checkpoint import _layout as layout
from lightning_rec.errors import CheckpointReplacedError
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.dist import launch
from tests.helpers.models import RecModel
from tests.helpers.scenarios import make_loader


def _trainer(**kwargs: Any) -> L.Trainer:
    args = {**QUIET_TRAINER, "accelerator": "cpu", "devices": 1, "max_steps": 2, **kwargs}
    if "callbacks" in kwargs:
        args["enable_checkpointing"] = True
    return L.Trainer(strategy=RecShardStrategy(), **args)


def _fill(model: torch.nn.Module, value: float) -> None:
    """Every weight of ``model`` (table shards in place, dense layers) set to ``value``."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            shards = tensor.local_shards() if hasattr(tensor, "local_shards") else None
            for t in [s.tensor for s in shards] if shards is not None else [tensor]:
                if t.is_floating_point():
                    t.fill_(value)


# --- a reader beside a writer ------------------------------------------------------------------------------------


def rewrite_last(rank: int, world_size: int, out_dir: Path, saves: int) -> dict[str, Any]:
    """The writer: a job that republishes ``last.ckpt`` ``saves`` times, every weight equal to the save's number."""
    L.seed_everything(0)
    model = RecModel()
    trainer = _trainer(max_steps=1)
    trainer.fit(model, make_loader(rank, 1, 8, {}))
    for step in range(1, saves + 1):
        _fill(model, float(step))
        trainer.save_checkpoint(Path(out_dir) / "last.ckpt")
        (Path(out_dir) / "saved").write_text(str(step))
    return {"saves": saves}


def test_a_reader_beside_a_writer_gets_one_whole_save_or_is_told_it_was_replaced(tmp_path):
    import threading

    done: dict[str, Any] = {}
    writer = threading.Thread(target=lambda: done.setdefault("run", launch(rewrite_last, 1, tmp_path, saves=60)))
    writer.start()
    deadline = time.monotonic() + 120
    while not (tmp_path / "saved").exists():
        assert writer.is_alive() and time.monotonic() < deadline, "the writer never saved"
        time.sleep(0.01)  # polling for the writer's first save
    whole, replaced, values = 0, 0, set()
    while writer.is_alive():
        try:
            export(tmp_path / "last.ckpt", tmp_path / "read.pt")
        except CheckpointReplacedError:
            replaced += 1
            continue
        state = load_exported(tmp_path / "read.pt")
        seen = {float(v.flatten()[0]) for v in state.values() if v.is_floating_point()}
        assert len(seen) == 1, f"one read mixed saves {sorted(seen)}"
        assert all(torch.all(v == v.flatten()[0]) for v in state.values() if v.is_floating_point())
        values |= seen
        whole += 1
    writer.join()
    assert done["run"].processes[0].returncode == 0, done["run"].processes[0].log[-3000:]
    assert whole >= 5 and len(values) >= 3, (whole, replaced, values)  # it really read while the writer wrote


def test_a_checkpoint_renamed_away_under_a_reader_is_never_called_a_file(tmp_path, monkeypatch):
    """The writer's first rename landing just after the reader looked (the flake CI met once: "is a file")."""
    ckpt, aside = tmp_path / "last.ckpt", layout._aside_path(tmp_path / "last.ckpt", "replaced")
    ckpt.mkdir()
    aside.parent.mkdir()
    layout.mark_complete(ckpt, {}, {"step": 1})
    real_exists = Path.exists

    def the_writer_renames_it_right_after(self: Path, *args: Any, **kwargs: Any) -> bool:
        there = real_exists(self, *args, **kwargs)
        if self == ckpt and there:
            os.rename(ckpt, aside)  # publish's first rename
        return there

    with monkeypatch.context() as m:
        m.setattr(Path, "exists", the_writer_renames_it_right_after)
        try:
            with layout.pin(ckpt, last_try=False) as pinned:
                assert pinned.manifest["step"] == 1  # read whole, before the rename
        except CheckpointReplacedError:
            pass  # or told to read again; never "is a file"
    if not ckpt.exists():  # between the publish's two renames: told to try again, and the last try reads the old one
        with pytest.raises(CheckpointReplacedError):
            with layout.pin(ckpt, last_try=False):
                pass
        with layout.pin(ckpt, last_try=True) as pinned:
            assert pinned.manifest["step"] == 1
        os.rename(aside, ckpt)
    aside.mkdir()  # a stale aside never stands in for a checkpoint that is there
    with layout.pin(ckpt, last_try=False) as pinned:
        assert pinned.manifest["step"] == 1
    shutil.rmtree(ckpt)
    shutil.rmtree(aside)
    with pytest.raises(CheckpointError, match="does not exist"):
        with layout.pin(ckpt):
            pass
    ckpt.write_text("a state dict")
    with pytest.raises(CheckpointError, match="is a file"):
        with layout.pin(ckpt):
            pass


# --- a full disk, a read-only directory ---------------------------------------------------------------------------


@contextlib.contextmanager
def _tmpfs(path: Path, size: int, readonly: bool = False) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if readonly else "")
    if (
        shutil.which("mount") is None
        or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root); the injected-ENOSPC test covers the message")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _size(path: Path) -> int:
    """Bytes on disk (whole pages, as a tmpfs counts them), with the directories."""
    return sum(max(p.stat().st_blocks * 512, 4096) for p in [path, *path.rglob("*")])


def test_a_full_disk_names_the_cause_keeps_the_last_checkpoint_and_leaves_nothing(tmp_path):
    L.seed_everything(0)
    model = RecModel()
    trainer = _trainer()
    trainer.fit(model, make_loader(0, 2, 8, {}))
    trainer.save_checkpoint(tmp_path / "probe.ckpt")
    need = _size(tmp_path / "probe.ckpt")
    with _tmpfs(tmp_path / "small", need + need // 2) as disk:  # room for one checkpoint, not two
        trainer.save_checkpoint(disk / "good.ckpt")
        before = layout.read_manifest(disk / "good.ckpt")
        with pytest.raises(CheckpointError) as err:
            trainer.save_checkpoint(disk / "next.ckpt")
        message = str(err.value)
        assert f"no space left on device writing {disk / 'next.ckpt'}" in message, message
        assert "rank 0:" in message and "MB free" in message and "needs ~" in message
        assert sorted(p.name for p in disk.iterdir()) == ["good.ckpt"], "the failed save left nothing behind"
        assert layout.read_manifest(disk / "good.ckpt") == before
        export(disk / "good.ckpt", tmp_path / "good.pt")  # still loads, hashes and all


def test_an_injected_enospc_is_named_with_the_space_needed(tmp_path, monkeypatch):
    L.seed_everything(0)
    model = RecModel()
    trainer = _trainer()
    trainer.fit(model, make_loader(0, 2, 8, {}))

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(layout, "write_file", full)
    with pytest.raises(CheckpointError, match=r"rank 0: no space left on device writing .*x.ckpt \(needs ~[\d.]+ MB"):
        trainer.save_checkpoint(tmp_path / "x.ckpt")
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_checkpoint_directory_is_refused_before_training(tmp_path):
    with _tmpfs(tmp_path / "ro", 1 << 20, readonly=True) as disk:
        L.seed_everything(0)
        model = RecModel()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = _trainer(callbacks=[ModelCheckpoint(dirpath=disk / "ckpts")])
        with pytest.raises(CheckpointError, match=r"(?s)ckpts: .*ro is not writable.*nothing was trained"):
            trainer.fit(model, make_loader(0, 2, 8, {}))
        assert trainer.global_step == 0
        after = model.state_dict()  # not sharded, not trained (its tables are still on `meta`)
        assert after.keys() == before.keys()
        assert all(after[k].is_meta or torch.equal(before[k], after[k]) for k in before)


# --- what a restart finds -----------------------------------------------------------------------------------------


def test_a_save_that_died_half_way_is_invisible_to_lightnings_hpc_scan(tmp_path):
    L.seed_everything(0)
    model = RecModel()
    trainer = _trainer(default_root_dir=str(tmp_path))
    trainer.fit(model, make_loader(0, 2, 8, {}))
    trainer.save_checkpoint(tmp_path / "hpc_ckpt_1.ckpt")
    # kill -9 in the middle of the next requeue save: its staging directory stays behind, half written
    shutil.copytree(tmp_path / "hpc_ckpt_1.ckpt", layout.staging_path(tmp_path / "hpc_ckpt_2.ckpt"))
    (layout.staging_path(tmp_path / "hpc_ckpt_2.ckpt") / layout.COMPLETE_FILE).unlink()
    again = _trainer(default_root_dir=str(tmp_path), max_steps=3)
    again.fit(RecModel(), make_loader(0, 3, 8, {}), ckpt_path="hpc")  # what a requeued SLURM job does
    assert again.global_step == 3  # resumed at step 2 from hpc_ckpt_1, one more step


def test_ckpt_path_last_finds_the_run_s_newest_complete_checkpoint_across_versions(tmp_path, caplog):
    def run(steps: int, ckpt_path: str | None = None) -> tuple[L.Trainer, RecModel]:
        L.seed_everything(0)
        model = RecModel()
        trainer = _trainer(
            max_steps=steps,
            logger=CSVLogger(tmp_path, name="run"),
            callbacks=[ModelCheckpoint(save_last=True, every_n_train_steps=2, save_top_k=-1)],
        )
        trainer.fit(model, make_loader(0, 8, 8, {}), ckpt_path=ckpt_path)
        return trainer, model

    first, _ = run(4)  # version_0: step=2, step=4, last (step 4)
    last = Path(first.checkpoint_callback.dirpath) / "last.ckpt"
    assert is_checkpoint(last) and "version_0" in str(last)
    # The restarted job logs to version_1, where Lightning's own "last" finds nothing and would start over.
    restarted, model = run(6, "last")
    assert restarted.global_step == 6 and "version_1" in restarted.checkpoint_callback.dirpath
    assert len(model.losses) == 2, "resumed at step 4, not started over"
    # A last.ckpt whose save failed (no COMPLETE) falls back to the newest complete checkpoint.
    newest = Path(restarted.checkpoint_callback.dirpath) / "last.ckpt"
    (newest / layout.COMPLETE_FILE).unlink()
    with caplog.at_level("INFO"):
        fallback, model = run(8, "last")
    assert fallback.global_step == 8 and len(model.losses) == 2  # from version_1's step-6 checkpoint
    assert any("resuming from" in r.message and "last.ckpt: incomplete, skipped" in r.message for r in caplog.records)


def test_the_cli_s_ckpt_path_last_resumes_a_restarted_run_from_its_earlier_version(tmp_path, caplog):
    """``lightning-rec fit --config ... --ckpt_path=last``, run again after the job stopped: the second run logs to
    ``version_1`` and must continue from ``version_0``'s checkpoint, not start over."""
    from lightning_rec._cli import run as cli

    args = [
        "fit",
        "--config",
        str(Path(__file__).resolve().parents[2] / "examples/configs/synthetic_dlrm.yaml"),
        "--trainer.devices=1",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--trainer.limit_val_batches=0",
        "--trainer.log_every_n_steps=1",
        "--data.init_args.train_rows=2048",
        "--data.init_args.batch_size=256",
        "--ckpt_path=last",
    ]
    first = cli([*args, "--trainer.max_epochs=1"]).trainer
    assert first.global_step == 8
    with caplog.at_level("INFO"):
        second = cli([*args, "--trainer.max_epochs=2"]).trainer
    assert second.global_step == 16
    assert "version_1" in second.logger.log_dir
    assert any("ckpt_path='last': resuming from" in r.message and "version_0" in r.message for r in caplog.records)
    import csv

    with open(Path(second.logger.log_dir) / "metrics.csv") as f:
        epochs = {row["epoch"] for row in csv.DictReader(f) if row.get("epoch")}
    assert epochs == {"1"}, f"the restarted run trained only the second epoch, not {sorted(epochs)}"
