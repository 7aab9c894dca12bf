"""A real SLURM job (issue 46, item 4): the sbatch script of the docs (``examples/slurm/train.sbatch``, shown in
docs/scaling-out.md) submitted to a single-node SLURM that ``scripts/setup_slurm.sh`` installs from the OS packages
and starts (once per test module; the tests skip, naming the reason, where the machine does not allow it: not root,
no apt-get). Two tasks run ``srun lightning-rec fit``; ``scancel --signal=USR1`` mid-epoch (what SLURM sends before a
job's time runs out, ``--signal=USR1@90``) must make the ranks save, rank 0 requeue the job, and the requeued job
(``SLURM_RESTART_COUNT=1``, the same command) resume from that checkpoint by itself and end with the weights of an
uninterrupted run of the same command under Lightning's own launcher (same seed, 2 ranks on one host).

test_preemption.py covers the same contract with SLURM's environment simulated and a stand-in ``scontrol``; here
SLURM itself starts the tasks, delivers the signal and runs the requeued job.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_rec.checkpoint import export, is_checkpoint, load_exported
from lightning_rec.testing import shell_env
from tests.helpers.dist import REPO

pytestmark = pytest.mark.dist

SETUP = REPO / "scripts" / "setup_slurm.sh"
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
CONFIG = REPO / "examples" / "configs" / "synthetic_dlrm.yaml"
STEPS, BATCH, EVERY = 160, 64, 20  # 2 ranks x 160 steps x 64 rows; a checkpoint every 20 steps
# The shipped config made small, and a checkpoint every EVERY steps: the one at step EVERY tells that the job is
# mid-epoch, the last one (step STEPS) holds the final weights.
ARGS = [
    "--trainer.max_epochs=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.limit_val_batches=0",
    f"--data.init_args.train_rows={2 * STEPS * BATCH}",
    f"--data.init_args.batch_size={BATCH}",
    "--data.init_args.val_rows=64",
    "--trainer.callbacks="
    + json.dumps(
        [
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"every_n_train_steps": EVERY, "save_top_k": -1},
            }
        ]
    ),
]
FINAL = f"epoch=0-step={STEPS}.ckpt"


def _env() -> dict[str, str]:
    """A user's shell with the project's environment active (sbatch hands it on to the job)."""
    env = shell_env()
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}  # a test run inside an allocation
    bin_dir = str(Path(sys.executable).parent)
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def slurm() -> None:
    """A single-node SLURM, started by the project's script (a no-op when it runs already)."""
    done = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=900, check=False)
    reason = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    if done.returncode == 3:
        pytest.skip(reason)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _job(job: str) -> dict[str, str]:
    """``scontrol show job``'s fields (SLURM keeps a finished job there for MinJobAge, 300 s by default)."""
    out = subprocess.run(["scontrol", "--oneliner", "show", "job", job], capture_output=True, text=True, check=False)
    return dict(field.split("=", 1) for field in out.stdout.split() if "=" in field)


def _wait(what: str, ready, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
            raise AssertionError(f"{what}: not after {timeout:.0f} s\n{tail}")
        time.sleep(0.1)  # polling SLURM and the job's files, with the deadline above


def _weights(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    export(checkpoint, out)
    return load_exported(out)


def test_scancel_usr1_mid_epoch_saves_requeues_and_the_requeued_job_resumes_exactly(slurm, tmp_path):
    env = _env()
    # The uninterrupted run: the same command under Lightning's launcher, beside the SLURM job (both are short).
    reference = subprocess.Popen(
        ["lightning-rec", "fit", "--config", str(CONFIG), *ARGS, f"--trainer.default_root_dir={tmp_path / 'ref'}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log, root = tmp_path / "job.out", tmp_path / "slurm"
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={log}", str(SBATCH), str(CONFIG), *ARGS,
         f"--trainer.default_root_dir={root}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        first = root / "lightning_logs" / "version_0" / "checkpoints" / f"epoch=0-step={EVERY}.ckpt"
        _wait("the job's first periodic checkpoint", lambda: is_checkpoint(first), 300, log)
        signalled = subprocess.run(["scancel", "--signal=USR1", job], capture_output=True, text=True, check=False)
        assert signalled.returncode == 0, signalled.stderr
        _wait(
            "the requeued job's end",
            lambda: _job(job).get("JobState") in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"},
            300,
            log,
        )
    finally:
        if _job(job).get("JobState") in {"PENDING", "RUNNING", "REQUEUED", "COMPLETING"}:
            subprocess.run(["scancel", job], check=False)
    state, text = _job(job), log.read_text()
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "1"), (state, text[-4000:])
    # The job ran twice, the second time as SLURM's restart 1 (what SLURM_RESTART_COUNT says).
    assert re.findall(rf"job {job}: start (\d+)", text) == ["0", "1"], text[-4000:]
    stops = re.findall(r"preempted by SIGUSR1 at step (\d+); checkpoint (\S+); SLURM job requeued", text)
    assert stops, text[-4000:]
    step, hpc = int(stops[0][0]), Path(stops[0][1])
    assert EVERY <= step < STEPS, "the signal landed mid-epoch"
    assert {s for s, _ in stops} == {str(step)}, stops  # every rank stopped after the same step
    assert hpc == root / "hpc_ckpt_1.ckpt" and is_checkpoint(hpc)
    # The requeued job, started with no ckpt_path, resumed from that checkpoint (Lightning's SLURM resume).
    assert f"Restoring states from the checkpoint path at {hpc}" in text, text[-4000:]

    out, _ = reference.communicate(timeout=600)
    assert reference.returncode == 0, out[-4000:]
    expected = _weights(next((tmp_path / "ref").rglob(FINAL)), tmp_path / "ref.pt")
    finals = sorted(root.rglob(FINAL))
    assert [p.parent.parent.name for p in finals] == ["version_1"], finals  # written by the requeued job
    got = _weights(finals[0], tmp_path / "slurm.pt")
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_the_setup_script_says_why_it_cannot_run_and_exits_3_for_the_tests_to_skip(tmp_path):
    """Not root (and no cluster configured: SLURM_CONF names no file): one line naming the reason, exit 3, nothing
    installed or started."""
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", str(SETUP)],
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLURM_CONF": str(tmp_path / "slurm.conf")},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == (
        "setup_slurm: SLURM cannot be set up on this machine: installing and starting SLURM's daemons needs root "
        "(this is uid 65534)"
    )
