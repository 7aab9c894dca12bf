"""When a rank fails mid-training, the others stop quickly, non-zero, saying which rank failed and why; a resume from
the last checkpoint then loses nothing beyond it. Real processes, real failures (an exception, SIGKILL, SIGSTOP)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lightning_rec._strategy.faults import (
    FailureBoard,
    collective_mismatch,
    describe_position,
    explain,
    is_communication_error,
)
from lightning_rec.testing import failure_time
from tests.helpers import checkpoint_scenarios
from tests.helpers.dist import REPO, launch, run_ranks
from tests.helpers.models import saved_weights

# Far below the 5-minute default timeout: a dead or raising peer is noticed through its closed connections.
PROMPT = 60.0


@pytest.mark.dist
def test_a_rank_that_raises_stops_the_other_at_once_with_its_error(tmp_path):
    run = launch(
        checkpoint_scenarios.fit_epochs, 2, tmp_path, tag="x", epochs=3, fail={"rank": 1, "step": 6, "how": "raise"}
    )
    rank0, rank1 = run.processes
    assert rank1.returncode != 0 and "RuntimeError: injected failure on rank 1" in rank1.log
    assert rank0.returncode not in (0, None)
    assert rank0.ended - failure_time(tmp_path, 1) < PROMPT
    # rank 0's own error says who failed first, why, where, and what to do
    assert "rank 0 of 2 stopped at training step 6 (epoch 1, batch 2)" in rank0.log
    assert (
        "because rank 1 failed first: RuntimeError at training step 6 (epoch 1, batch 2): injected failure on rank 1"
        in rank0.log
    )
    assert "ckpt_path='last'" in rank0.log


@pytest.mark.dist
def test_a_killed_rank_ends_the_job_quickly_and_a_resume_loses_nothing(tmp_path):
    straight = run_ranks(checkpoint_scenarios.fit_epochs, 2, tmp_path / "straight", tag="w", epochs=3)

    crashed = tmp_path / "crashed"
    run = launch(
        checkpoint_scenarios.fit_epochs, 2, crashed, tag="x", epochs=3, fail={"rank": 1, "step": 6, "how": "kill"}
    )
    rank0, rank1 = run.processes
    assert rank1.returncode == -signal.SIGKILL
    assert rank0.returncode not in (0, None) and rank0.ended - failure_time(crashed, 1) < PROMPT
    assert "no rank reported an error of its own: a rank was most likely killed" in rank0.log
    # the epoch-0 checkpoint survived the crash; nothing of the interrupted epoch was written
    assert sorted(p.name for p in (crashed / "ckpts").iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]

    resumed = run_ranks(
        checkpoint_scenarios.fit_epochs,
        2,
        crashed,
        tag="resumed",
        epochs=3,
        ckpt_path=str(crashed / "ckpts" / "last.ckpt"),
    )
    for rank in range(2):
        assert resumed[rank]["global_step"] == 12
        assert resumed[rank]["losses"] == straight[rank]["losses"][4:]  # bit-identical: nothing lost, nothing changed
    a, b = saved_weights(tmp_path / "straight", "w", 2), saved_weights(crashed, "resumed", 2)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.dist
def test_a_hung_rank_is_given_up_on_after_the_configured_timeout(tmp_path):
    timeout = 20.0
    run = launch(
        checkpoint_scenarios.fit_epochs,
        2,
        tmp_path,
        tag="x",
        epochs=2,
        strategy={"timeout": timeout},
        fail={"rank": 1, "step": 2, "how": "hang"},
        wait_for=["rank0"],
        timeout=240,
    )
    rank0 = run.processes[0]
    assert run.processes[1].returncode is None, "the stopped rank never exits by itself"
    waited = rank0.ended - failure_time(tmp_path, 1)
    assert rank0.returncode not in (0, None)
    assert timeout - 2 < waited < timeout + PROMPT, waited
    assert "Timed out waiting 20000ms" in rank0.log
    assert "stopped answering for longer than the collective timeout (0:00:20" in rank0.log


@pytest.mark.dist
def test_lightning_launched_job_ends_when_a_child_rank_is_killed(tmp_path):
    """`Trainer(devices=2)` with Lightning's own launcher (rank 1 is rank 0's child process): the job ends non-zero."""
    script = [sys.executable, "-m", "tests.helpers.launched_job", "--out", str(tmp_path), "--fail", "1:3:kill"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    ended = time.time()
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ended - failure_time(tmp_path, 1) < PROMPT
    assert not (tmp_path / "finished").exists()


# ------------------------------------------------------------------------------------------------------------
# The pieces, in one process.
# ------------------------------------------------------------------------------------------------------------


def test_communication_errors_are_told_from_causes():
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"
    )
    assert is_communication_error(gloo)
    assert is_communication_error(torch.distributed.DistNetworkError("store gone"))
    try:
        try:
            raise gloo
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert is_communication_error(outer)
    assert not is_communication_error(ValueError("feature 'user' has id 12"))
    assert not is_communication_error(RuntimeError("CUDA out of memory"))
    # Sizes that do not fit together are the ranks' own error (every rank is alive), never a lost rank.
    sizes = RuntimeError("ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (4, 24), got (5, 24))")
    assert collective_mismatch(sizes) == str(sizes) and collective_mismatch(gloo) is None
    bytes_sent = RuntimeError(
        "[enforce fail at ../gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 8 vs 4"
    )
    assert collective_mismatch(bytes_sent) is not None


def test_failure_board_reports_the_first_failure_only_under_its_run_token():
    store = torch.distributed.HashStore()
    a1, a2 = FailureBoard(store, "run-a", rank=1), FailureBoard(store, "run-a", rank=2)
    assert a1.first() is None
    a2.publish("ValueError: first")
    a1.publish("RuntimeError: second")
    assert FailureBoard(store, "run-a", rank=0).first() == (2, "ValueError: first")
    assert FailureBoard(store, "run-b", rank=0).first() is None  # another run of the same process group


def test_explanations_name_the_cause_or_the_timeout():
    from datetime import timedelta

    told = explain(0, 4, "training step 3 (epoch 0, batch 3)", (2, "InputError: bad id"), timedelta(minutes=5))
    assert told.startswith("RecShardStrategy: rank 0 of 4 stopped at training step 3 (epoch 0, batch 3)")
    assert "rank 2 failed first: InputError: bad id" in told
    silent = explain(1, 2, "", None, timedelta(seconds=30))
    assert "no rank reported an error" in silent and "(0:00:30; `RecShardStrategy(timeout=...)`)" in silent


def test_positions_follow_lightning_progress():
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    def progress(ready):
        return SimpleNamespace(batch_progress=SimpleNamespace(current=SimpleNamespace(ready=ready)))

    trainer = SimpleNamespace(
        state=SimpleNamespace(stage=RunningStage.TRAINING, fn=TrainerFn.FITTING),
        global_step=12,
        current_epoch=1,
        training=True,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_idx=4, val_loop=progress(3))),
        validate_loop=progress(8),
        test_loop=progress(2),
        predict_loop=progress(5),
    )
    assert describe_position(trainer) == "training step 12 (epoch 1, batch 4)"
    assert describe_position(trainer, ahead=1) == "training step 13 (epoch 1, batch 5)"
    trainer.state.stage, trainer.training = RunningStage.VALIDATING, False
    assert describe_position(trainer) == "validation batch 2"  # inside fit: the fit loop's validation
    trainer.state.fn = TrainerFn.VALIDATING
    assert describe_position(trainer) == "validation batch 7"
    trainer.state.stage = RunningStage.PREDICTING
    assert describe_position(trainer) == "predict batch 4"
    trainer.state.stage, trainer.training = RunningStage.TRAINING, True
    assert describe_position(trainer, transferring=True) == "training step 12 (epoch 1, batch 5)"


def test_a_rank_publishes_its_own_error_and_explains_a_consequence():
    store = torch.distributed.HashStore()
    failing, waiting = FailureBoard(store, "run", rank=1), FailureBoard(store, "run", rank=0)
    failing.handle(RuntimeError("boom"), "training step 4 (epoch 0, batch 4)", 2, None)
    assert waiting.first() == (1, "RuntimeError at training step 4 (epoch 0, batch 4): boom")
    consequence = RuntimeError("[/gloo/transport/tcp/pair.cc:1] Connection closed by peer")
    waiting.handle(consequence, "training step 4 (epoch 0, batch 4)", 2, None)
    assert "rank 1 failed first: RuntimeError at training step 4" in consequence.__notes__[0]
    assert waiting.first() == (1, "RuntimeError at training step 4 (epoch 0, batch 4): boom"), (
        "consequences are not published"
    )


def gathers_per_rank_sizes(rank: int, world_size: int, out_dir) -> dict:
    """A model whose step 2 all-gathers its labels (5 on rank 0, 4 on rank 1) into pieces sized for the largest batch,
    as a per-sample metric gathered by hand would: gloo refuses rank 1's 4 where it expects 5, before sending."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from tests.helpers.models import RecModel, make_batches
    from tests.helpers.scenarios import make_trainer

    class Gathers(RecModel):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                mine = batch.labels.detach()
                dist.all_gather([torch.empty(5) for _ in range(world_size)], mine)
            return super().training_step(batch, batch_idx)

    loader = DataLoader(make_batches(4, 5 - rank, seed=rank), batch_size=None)
    make_trainer(world_size, 4).fit(Gathers(), loader)
    return {}


@pytest.mark.dist
def test_a_collective_given_unequal_sizes_names_them_and_the_cause_not_a_lost_rank(tmp_path):
    run = launch(gathers_per_rank_sizes, 2, tmp_path)
    rank0, rank1 = run.processes
    mismatch = (
        "a collective operation failed because the ranks gave it tensors whose sizes differ where it needs them equal: "
        "ProcessGroupGloo::allgather: invalid tensor size at index 0"
    )
    assert rank1.returncode not in (0, None) and rank0.returncode not in (0, None)
    assert f"rank 1 of 2 stopped at training step 2 (epoch 0, batch 2): {mismatch}" in rank1.log
    told = "because rank 1 failed first: RuntimeError at training step 2 (epoch 0, batch 2): " + mismatch
    assert "rank 0 of 2 stopped at training step 2 (epoch 0, batch 2): a collective operation failed " + told in (
        rank0.log
    )
    for process in run.processes:
        assert "Likely cause:" in process.log and "most likely killed" not in process.log, process.log[-3000:]
