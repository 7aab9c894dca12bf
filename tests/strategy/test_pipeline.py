"""Pipelined input distribution (`RecShardStrategy(pipeline=True)`) inside Lightning's loop."""

from __future__ import annotations

import pytest

from tests.helpers import pipeline_scenarios
from tests.helpers.dist import run_ranks

pytestmark = pytest.mark.dist


def test_pipelined_training_matches_the_plain_loop_on_two_processes(tmp_path):
    """Same per-step losses, validation, logging, checkpoints and predictions as without pipelining."""
    plain = run_ranks(pipeline_scenarios.fit, 2, tmp_path / "plain", pipeline=False)
    piped = run_ranks(pipeline_scenarios.fit, 2, tmp_path / "piped", pipeline=True)
    for a, b in zip(plain, piped):
        assert b["pipelined"] == "SparseDistPipeline"
        # training ran TorchRec's pipelined forward (inputs distributed ahead); evaluation the module's own
        assert b["forwards"] == {"train": ["PipelinedForward"], "val": ["method"]}
        assert a["forwards"] == {"train": ["method"], "val": ["method"]}
        assert len(a["losses"]) == 12 and b["closure_calls"] == a["closure_calls"] == 12
        assert b["losses"] == pytest.approx(a["losses"], abs=1e-5)
        assert b["global_step"] == a["global_step"] == 12
        # validation ran the evaluation forwards (not training steps), twice, on the same weights
        assert b["val_batches"] == a["val_batches"] == 4
        assert b["val_losses"] == pytest.approx(a["val_losses"], abs=1e-5)
        assert b["logged_train_loss"] == pytest.approx(a["logged_train_loss"], abs=1e-5)
        assert b["predictions"] == pytest.approx(a["predictions"], abs=1e-5)
        assert a["last_complete"] and b["last_complete"]
