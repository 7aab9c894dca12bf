"""Checkpoints a start can trust (issue 51, items 2, 3, 6): ``ckpt_path="last"`` resumes only this run's model, every
leftover of a dead save or another job is skipped with one line (the SLURM requeue start included), and a second job
writing the same folder is refused at its start.

The leftovers are crafted from one saved checkpoint (a module fixture) and resolved through the real start: a
``fit`` with ``ckpt_path="hpc"``/``"last"`` (or none, as a requeued SLURM job starts), which then must continue from
the intact checkpoint (one more step trained, not three).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment

from lightning_rec import RecShardStrategy
from lightning_rec._strategy.run_identity import RUN_ID_ENV, run_identity
from lightning_rec.checkpoint import _layout as layout
from lightning_rec.checkpoint._lock import LOCK_FILE, FolderLock
from lightning_rec.errors import CheckpointError
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.cluster_jobs import user_env, wait_for
from tests.helpers.data import REPO
from tests.helpers.dist import in_this_process, launch
from tests.helpers.models import RecModel
from tests.helpers.scenarios import make_loader

SAVED_STEP = 2  # the fixture's checkpoint; every resume below trains to step 3: one step if it resumed


def _trainer(root: Path, steps: int = SAVED_STEP + 1, **kwargs: Any) -> L.Trainer:
    if "callbacks" in kwargs:
        kwargs["enable_checkpointing"] = True
    args = {**QUIET_TRAINER, "accelerator": "cpu", "devices": 1, "max_steps": steps, "default_root_dir": root}
    return L.Trainer(strategy=RecShardStrategy(), **{**args, **kwargs})


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete checkpoint of this run at step 2 (``RecModel``, one rank)."""
    root = tmp_path_factory.mktemp("saved")
    L.seed_everything(0)
    with in_this_process(root):  # a module fixture: conftest's per-test isolation does not reach it
        trainer = _trainer(root, steps=SAVED_STEP)
        trainer.fit(RecModel(), make_loader(0, SAVED_STEP, 8, {}))
        trainer.save_checkpoint(root / "source.ckpt")
    return root / "source.ckpt"


def _copy(saved: Path, to: Path, *, complete: bool = True) -> Path:
    to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(saved, to, copy_function=shutil.copy)  # written now, as a later save would be
    if not complete:
        (to / layout.COMPLETE_FILE).unlink()
    return to


def _set_run(checkpoint: Path, run: str) -> None:
    manifest = json.loads((checkpoint / layout.COMPLETE_FILE).read_text())
    (checkpoint / layout.COMPLETE_FILE).write_text(json.dumps({**manifest, "run": run}))


def _corrupt(checkpoint: Path) -> None:
    """One byte of a tensor file flipped, size unchanged: only its SHA-256 tells."""
    data = sorted(checkpoint.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def _resume(root: Path, ckpt_path: str | None, **kwargs: Any) -> tuple[L.Trainer, RecModel]:
    L.seed_everything(0)
    model = RecModel()
    trainer = _trainer(root, **kwargs)
    trainer.fit(model, make_loader(0, SAVED_STEP + 1, 8, {}), ckpt_path=ckpt_path)
    return trainer, model


def _said(caplog: pytest.LogCaptureFixture, recwarn: pytest.WarningsRecorder) -> str:
    return "\n".join([r.getMessage() for r in caplog.records] + [str(w.message) for w in recwarn])


# --- "last" means this run ------------------------------------------------------------------------------------------


def test_the_run_id_is_the_launcher_s_across_restarts_and_the_config_tells_runs_apart():
    a, b = RecModel(lr=0.1), RecModel(lr=0.1)
    a.save_hyperparameters({"dense_lr": 0.001})
    b.save_hyperparameters({"dense_lr": 0.01})
    same = run_identity(a, None, environ={})
    assert same == run_identity(a, None, environ={}) and same != run_identity(b, None, environ={})
    slurm = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "1"}
    assert run_identity(a, None, environ=slurm) == run_identity(a, None, environ={"SLURM_JOB_ID": "41"})
    assert run_identity(a, None, environ={"SLURM_JOB_ID": "42"}) != run_identity(a, None, environ=slurm)
    # torchrun's default --rdzv-id names no run; a given one does, across its restarts
    assert run_identity(a, None, environ={"TORCHELASTIC_RUN_ID": "none"}) == same
    assert run_identity(a, None, environ={"TORCHELASTIC_RUN_ID": "j7"}).startswith("torchrun:j7/")
    # the user's id alone names the run (a new job, a changed config)
    assert run_identity(a, None, environ={RUN_ID_ENV: "ctr", "SLURM_JOB_ID": "41"}) == "user:ctr"
    assert run_identity(b, None, environ={}, explicit="ctr") == "user:ctr"


CLI_RUN = [
    "fit",
    "--config",
    str(REPO / "examples/configs/synthetic_dlrm.yaml"),
    "--trainer.devices=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.limit_val_batches=0",
    "--trainer.log_every_n_steps=1",
    "--data.init_args.train_rows=1024",
    "--data.init_args.batch_size=256",
    "--ckpt_path=last",
]


def _trained_epochs(trainer: L.Trainer) -> set[str]:
    import csv

    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return {row["epoch"] for row in csv.DictReader(f) if row.get("epoch")}


@pytest.mark.dist  # three CLI fits of the shipped config
def test_last_in_a_shared_root_resumes_only_the_same_run(tmp_path, caplog, recwarn):
    """The issue's case: the shipped config, one ``default_root_dir``, ``--ckpt_path=last`` on every command."""
    from lightning_rec._cli import run as cli

    def run(dense_lr: float, epochs: int) -> L.Trainer:
        args = [f"--trainer.default_root_dir={tmp_path}", f"--model.init_args.dense_lr={dense_lr}"]
        return cli([*CLI_RUN, *args, f"--trainer.max_epochs={epochs}"]).trainer

    first = run(0.001, 1)
    assert first.global_step == 4
    caplog.clear()
    other = run(0.01, 2)  # a new experiment: must not continue the first one's model
    assert other.global_step == 8 and _trained_epochs(other) == {"0", "1"}
    said = _said(caplog, recwarn)
    assert "no checkpoint of this run" in said and "starting from scratch" in said and "version_0" in said, said
    caplog.clear()
    dead = layout.staging_path(tmp_path / "lightning_logs/version_0/checkpoints/epoch=1-step=6.ckpt")
    dead.mkdir(parents=True)  # the first run's save that a kill -9 interrupted
    restarted = run(0.001, 2)  # the first run again (restarted): continues its own checkpoint, not the newer one
    assert restarted.global_step == 8 and _trained_epochs(restarted) == {"1"}
    assert not dead.parent.exists(), "a dead save's staging, in a folder the restart does not write, is cleared"
    line = next(r.getMessage() for r in caplog.records if "resuming from" in r.getMessage())
    assert "version_0" in line and "another run's, skipped" in line, line


# --- every leftover is survivable -----------------------------------------------------------------------------------


def _hpc_leftovers() -> dict[str, tuple[Callable[[Path, Path], None], str]]:
    """Each kind: how to leave it beside a complete ``hpc_ckpt_1.ckpt``, and what the start must say."""
    return {
        "incomplete": (
            lambda saved, root: _copy(saved, root / "hpc_ckpt_2.ckpt", complete=False) and None,
            "hpc_ckpt_2.ckpt: incomplete, skipped",
        ),
        "empty file": (
            lambda saved, root: (root / "hpc_ckpt_2.ckpt").touch(),
            "hpc_ckpt_2.ckpt: empty file, not a checkpoint, skipped",
        ),
        "old staging name": (
            lambda saved, root: _copy(saved, root / ".hpc_ckpt_2.ckpt.partial", complete=False) and None,
            ".hpc_ckpt_2.ckpt.partial: removed",
        ),
        "foreign name": (
            lambda saved, root: _copy(saved, root / "hpc_ckpt_final.ckpt") and None,
            "hpc_ckpt_final.ckpt: not an hpc checkpoint name, skipped",
        ),
        "another run's": (
            lambda saved, root: _set_run(_copy(saved, root / "hpc_ckpt_2.ckpt"), "slurm:1/config:000000000000"),
            "hpc_ckpt_2.ckpt: another run's, skipped",
        ),
        "corrupt, marked complete": (
            lambda saved, root: _corrupt(_copy(saved, root / "hpc_ckpt_2.ckpt")),
            "SHA-256 differs",
        ),
    }


@pytest.mark.parametrize("kind", list(_hpc_leftovers()))
def test_a_requeue_start_skips_each_leftover_and_resumes_the_newest_intact(kind, saved, tmp_path, caplog, recwarn):
    leave, expected = _hpc_leftovers()[kind]
    _copy(saved, tmp_path / "hpc_ckpt_1.ckpt")
    leave(saved, tmp_path)
    with caplog.at_level("INFO"):
        trainer, model = _resume(tmp_path, "hpc")  # what Lightning's SLURM requeue start asks for
    assert trainer.global_step == SAVED_STEP + 1 and len(model.losses) == 1, "resumed from hpc_ckpt_1"
    said = _said(caplog, recwarn)
    assert expected in said, said
    assert not (tmp_path / ".hpc_ckpt_2.ckpt.partial").exists(), "a dead save's staging is cleared at the start"


def test_the_requeue_start_with_no_ckpt_path_takes_the_intact_checkpoint(saved, tmp_path, monkeypatch):
    """A requeued job starts with no ``ckpt_path``; on SLURM Lightning then resumes the highest ``hpc_ckpt_<n>``."""
    _copy(saved, tmp_path / "hpc_ckpt_1.ckpt")
    (tmp_path / "hpc_ckpt_2.ckpt").touch()
    L.seed_everything(0)
    model, trainer = RecModel(), _trainer(tmp_path)
    monkeypatch.setattr(SLURMEnvironment, "detect", staticmethod(lambda: True))  # after the Trainer chose its env
    trainer.fit(model, make_loader(0, SAVED_STEP + 1, 8, {}))
    assert trainer.global_step == SAVED_STEP + 1 and len(model.losses) == 1


def test_last_falls_back_from_a_corrupt_complete_last_ckpt(saved, tmp_path, caplog, recwarn):
    folder = tmp_path / "ckpts"
    _copy(saved, folder / "epoch=0-step=2.ckpt")
    _corrupt(_copy(saved, folder / "last.ckpt"))  # newer, marked complete, one tensor file damaged
    with caplog.at_level("INFO"):
        trainer, model = _resume(tmp_path, "last", callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)])
    assert trainer.global_step == SAVED_STEP + 1 and len(model.losses) == 1
    said = _said(caplog, recwarn)
    assert f"{folder / 'last.ckpt'}: cannot be resumed from" in said and "SHA-256 differs" in said, said
    assert f"trying {folder / 'epoch=0-step=2.ckpt'}" in said, said


def test_a_dead_save_s_staging_and_a_half_published_last_are_tidied_at_the_next_start(saved, tmp_path, caplog):
    folder = tmp_path / "ckpts"
    # kill -9 during a save of last.ckpt (its staging), and during the publish before (between its two renames)
    _copy(saved, layout.staging_path(folder / "epoch=0-step=9.ckpt"), complete=False)
    _copy(saved, layout._aside_path(folder / "last.ckpt", "replaced"))
    with caplog.at_level("INFO"):
        trainer, model = _resume(tmp_path, "last", callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)])
    assert trainer.global_step == SAVED_STEP + 1 and len(model.losses) == 1, "resumed from the one put aside"
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "epoch=0-step=9.ckpt.partial: removed" in said and "last.ckpt: put back" in said, said
    assert not (folder / layout.WORK_DIR).exists() and layout.read_manifest(folder / "last.ckpt")["global_step"] == 2


def test_last_with_only_another_run_s_checkpoint_starts_from_scratch_naming_it(saved, tmp_path, recwarn):
    folder = tmp_path / "ckpts"
    _set_run(_copy(saved, folder / "last.ckpt"), "user:someone-else")
    trainer, model = _resume(tmp_path, "last", callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)])
    assert trainer.global_step == SAVED_STEP + 1 and len(model.losses) == SAVED_STEP + 1, "started from scratch"
    said = [str(w.message) for w in recwarn if "no checkpoint of this run" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0], said
    assert str(folder / "last.ckpt") in said[0] and "LIGHTNING_REC_RUN_ID=someone-else" in said[0], said


def requeued(rank: int, world_size: int, out_dir: Path, steps: int) -> dict[str, Any]:
    """A requeued SLURM job's rank: the same command, no ``ckpt_path``."""
    L.seed_everything(0)
    model = RecModel()
    trainer = L.Trainer(
        strategy=RecShardStrategy(),
        accelerator="cpu",
        devices=world_size,
        max_steps=steps,
        default_root_dir=out_dir,
        **QUIET_TRAINER,
    )
    trainer.fit(model, make_loader(rank, steps, 8, {}))
    return {"global_step": trainer.global_step, "trained": len(model.losses)}


@pytest.mark.dist
def test_a_requeued_slurm_job_starts_past_every_leftover(saved, tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_ID_ENV, "requeue-test")  # the launcher's SLURM_JOB_ID is new on every launch
    _set_run(_copy(saved, tmp_path / "hpc_ckpt_1.ckpt"), "user:requeue-test")
    _copy(saved, tmp_path / "hpc_ckpt_2.ckpt", complete=False)
    (tmp_path / "hpc_ckpt_3.ckpt").touch()
    _copy(saved, tmp_path / ".hpc_ckpt_4.ckpt.partial", complete=False)
    run = launch(requeued, 2, tmp_path, launcher="slurm", timeout=240, steps=SAVED_STEP + 1)
    assert all(p.returncode == 0 for p in run.processes), run.log("rank0")[-3000:]
    assert [r and (r["global_step"], r["trained"]) for r in run.results] == [(SAVED_STEP + 1, 1)] * 2
    line = next(x for x in run.log("rank0").splitlines() if "SLURM requeue start: resuming from" in x)
    assert "hpc_ckpt_1.ckpt" in line and "hpc_ckpt_3.ckpt: empty file" in line and "hpc_ckpt_2.ckpt: incomplete" in line
    assert not (tmp_path / ".hpc_ckpt_4.ckpt.partial").exists()


# --- one writer per checkpoint folder -------------------------------------------------------------------------------

_JOB = """
import sys, time, pathlib, lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_rec import RecShardStrategy
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.models import RecModel
from tests.helpers.scenarios import make_loader
folder, root, hold = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3] == "hold"
after = pathlib.Path(sys.argv[4]) if len(sys.argv) > 4 else None
root.mkdir(parents=True)
while after is not None and not after.exists():  # started beside the first job: imports done, waits for its save
    time.sleep(0.05)
class Hold(L.Callback):
    def on_train_batch_start(self, trainer, *args):
        if hold and trainer.global_step == 1:  # after its first save into the folder
            (root / "holding").write_text("")
            while True:
                time.sleep(1)  # until killed
args = {**QUIET_TRAINER, "enable_checkpointing": True, "max_steps": 2, "default_root_dir": root}
t = L.Trainer(strategy=RecShardStrategy(), accelerator="cpu", devices=1, **args,
              callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1), Hold()])
t.fit(RecModel(), make_loader(0, 2, 8, {}))
print("trained", t.global_step)
"""


def _job(folder: Path, root: Path, hold: bool, after: Path | None = None) -> subprocess.Popen[str]:
    """A job's process, its output in ``<root>.log`` (a pipe nobody reads while it runs would fill and stop it)."""
    env = {**user_env(), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", _JOB, str(folder), str(root), "hold" if hold else "go", *filter(None, [after])]
    with open(f"{root}.log", "w") as log:
        return subprocess.Popen([str(c) for c in command], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.dist
def test_a_second_job_writing_the_same_folder_is_refused_and_a_dead_job_holds_nothing(tmp_path):
    folder = tmp_path / "ckpts"
    holder = _job(folder, tmp_path / "a", hold=True)
    second = _job(folder, tmp_path / "b", hold=False, after=tmp_path / "a" / "holding")
    try:
        log = (tmp_path / "a.log").read_text
        wait_for("the first job's first save", (tmp_path / "a" / "holding").exists, 300, log)
        second.wait(timeout=300)
        out = (tmp_path / "b.log").read_text()
        assert second.returncode != 0 and "trained 2" not in out, out[-3000:]
        refusal = next(line for line in out.splitlines() if "is in use by another job" in line)
        assert str(folder) in refusal and f"pid {holder.pid}" in refusal, refusal
        assert not (tmp_path / "b" / "holding").exists()
    finally:
        holder.send_signal(signal.SIGKILL)  # a job killed: its lock dies with it
        holder.wait()
        if second.poll() is None:
            second.kill()
            second.wait()
    assert not (folder / LOCK_FILE).exists()  # the folder itself is locked: nothing written into it
    FolderLock.acquire(folder, "the next job").release()  # taken at once: the dead job holds nothing
    saved = {p.name: layout.read_manifest(p)["global_step"] for p in folder.glob("*.ckpt")}
    assert saved == {"epoch=0-step=1.ckpt": 1}, saved  # the first job's save, complete; nothing of the second's


def test_a_save_into_a_folder_another_job_holds_is_refused_on_every_rank(saved, tmp_path):
    """Outside the folders a fit holds (a preempted job's hpc checkpoint, ``trainer.save_checkpoint`` anywhere), a
    save locks its folder for its own time: another job's lock there refuses it, and nothing is written."""
    L.seed_everything(0)
    trainer = _trainer(tmp_path / "root", steps=1)
    trainer.fit(RecModel(), make_loader(0, 1, 8, {}))
    other = FolderLock.acquire(tmp_path / "shared", "slurm:9/config:000000000000")  # another job's, open apart
    try:
        with pytest.raises(
            CheckpointError, match=rf"in use by another job \(.*pid {os.getpid()}\).*hpc_ckpt_1.ckpt was not"
        ):
            trainer.save_checkpoint(tmp_path / "shared" / "hpc_ckpt_1.ckpt")
        assert [p.name for p in (tmp_path / "shared").iterdir()] == []
    finally:
        other.release()
    trainer.save_checkpoint(tmp_path / "shared" / "hpc_ckpt_1.ckpt")
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["hpc_ckpt_1.ckpt"]


def test_where_a_directory_cannot_be_locked_a_lock_file_names_the_holder(tmp_path, monkeypatch):
    """A file system refusing a directory's ``flock`` (NFS): the lock is taken on ``LOCK_FILE`` instead, which names
    the holder's run, and is removed when released."""
    import fcntl

    from lightning_rec.checkpoint import _lock

    real = fcntl.flock

    def no_directory_locks(fd: int, operation: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(9, "Bad file descriptor")
        real(fd, operation)

    monkeypatch.setattr(_lock.fcntl, "flock", no_directory_locks)
    first = FolderLock.acquire(tmp_path, "user:first")
    assert first.file and (tmp_path / LOCK_FILE).exists()
    with pytest.raises(CheckpointError, match=rf"in use by another job \(host .*, pid {os.getpid()}, run user:first\)"):
        FolderLock.acquire(tmp_path, "user:second")
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    FolderLock.acquire(tmp_path, "user:second").release()
