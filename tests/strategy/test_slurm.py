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

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_rec.checkpoint import is_checkpoint
from tests.helpers.cluster_jobs import CONFIG, assert_same_weights, small_run, user_env, wait_for, weights
from tests.helpers.dist import REPO

pytestmark = pytest.mark.dist

SETUP = REPO / "scripts" / "setup_slurm.sh"
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
STEPS, BATCH, EVERY = 120, 64, 40  # per rank; a checkpoint every EVERY steps (the first: mid-epoch)
ARGS = small_run(STEPS, BATCH, EVERY)
FINAL = f"epoch=0-step={STEPS}.ckpt"


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


def _wait_job(what: str, ready, log: Path) -> None:
    wait_for(what, ready, 300, lambda: log.read_text() if log.exists() else "")


@pytest.fixture
def reference(tmp_path: Path) -> Iterator[subprocess.Popen]:
    """The uninterrupted run: the same command under Lightning's launcher (2 processes on one host), started beside
    the SLURM job (both are short); killed with its ranks if the test ends first."""
    command = ["lightning-rec", "fit", "--config", str(CONFIG), *ARGS, f"--trainer.default_root_dir={tmp_path / 'ref'}"]
    with (tmp_path / "ref.log").open("w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=user_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    yield process
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_scancel_usr1_mid_epoch_saves_requeues_and_the_requeued_job_resumes_exactly(slurm, reference, tmp_path):
    env = user_env()
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
        _wait_job("the job's first periodic checkpoint", lambda: is_checkpoint(first), log)
        signalled = subprocess.run(["scancel", "--signal=USR1", job], capture_output=True, text=True, check=False)
        assert signalled.returncode == 0, signalled.stderr
        ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}
        _wait_job("the requeued job's end", lambda: _job(job).get("JobState") in ended, log)
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

    assert reference.wait(timeout=600) == 0, (tmp_path / "ref.log").read_text()[-4000:]
    expected = weights(next((tmp_path / "ref").rglob(FINAL)), tmp_path / "ref.pt")
    finals = sorted(root.rglob(FINAL))
    assert [p.parent.parent.name for p in finals] == ["version_1"], finals  # written by the requeued job
    assert_same_weights(weights(finals[0], tmp_path / "slurm.pt"), expected)


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


def _daemons() -> dict[str, str]:
    return {name: Path(f"/run/{name}.pid").read_text().strip() for name in ("slurmctld", "slurmd")}


def test_the_setup_script_run_again_checks_the_cluster_and_restarts_nothing(slurm):
    """Idempotent and quick: with the cluster up, a second run only checks it (the daemons keep their pids)."""
    before = _daemons()
    done = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("setup_slurm: the cluster is up (node localhost: idle")
    assert _daemons() == before
