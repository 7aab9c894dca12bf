"""TorchRec's messages that do not apply to a recshard run are silenced, and only those."""

from __future__ import annotations

import logging
import warnings

from lightning_rec._strategy.quiet import torchrec_noise_silenced


def test_only_the_named_torchrec_messages_are_dropped(caplog):
    caplog.set_level(logging.INFO)
    utils = logging.getLogger("torchrec.distributed.utils")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the user's filters; the block's own go on top, as in a run
        with torchrec_noise_silenced():
            logging.warning("Sharding spec not found for ebc.t_user")
            utils.warning("Sharding Type is data_parallel, caching params will be ignored")
            warnings.warn(
                "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead.", FutureWarning, stacklevel=1
            )
            logging.warning("Rank is not assigned for shard")  # anything else still reaches the user
            utils.warning("Compute Kernel is dense, something else")
            warnings.warn("another deprecation", FutureWarning, stacklevel=1)
    assert [r.getMessage() for r in caplog.records] == [
        "Rank is not assigned for shard",
        "Compute Kernel is dense, something else",
    ]
    assert [str(w.message) for w in caught] == ["another deprecation"]
    caplog.clear()
    logging.warning("Sharding spec not found for ebc.t_user")  # the filters are gone after the block
    assert len(caplog.records) == 1


def test_a_fit_with_a_data_parallel_table_prints_none_of_them(tmp_path, caplog):
    from tests.strategy.test_torchrec_models import TABLE_WISE_PLAN, fit

    caplog.set_level(logging.WARNING)
    plan = {**TABLE_WISE_PLAN, "weighted_table_1": {"sharding_types": ["data_parallel"]}}
    result = fit(0, 1, tmp_path, constraints=plan, steps=1)
    assert result["plan"]["weighted_table_1"] == "data_parallel"
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "Sharding spec not found" in m or "caching params will be ignored" in m], said


def test_each_progress_bar_line_is_printed_once(capsys, tmp_path):
    """Lightning's default bar printed "Training: 0/?" twice (created, then reset at the epoch's start), and likewise
    "Validation: 0/?": in a log file or a notebook both stay. Under recshard each line is printed once."""
    import re

    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_rec import RecShardStrategy
    from tests.helpers.models import RecModel, make_batches

    trainer = L.Trainer(
        strategy=RecShardStrategy(),
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(
        RecModel(),
        DataLoader(make_batches(3, 8, seed=0), batch_size=None),
        DataLoader(make_batches(2, 8, seed=1), batch_size=None),
    )
    lines = [line.strip() for line in re.split(r"[\r\n]", capsys.readouterr().out) if line.strip()]
    firsts = [line for line in lines if line.startswith(("Training", "Validation"))]
    assert any(line.startswith("Training") for line in firsts), lines  # the bar ran
    assert len(firsts) == len(set(firsts)), firsts


def test_the_proven_harmless_filters_can_be_turned_off_by_the_environment():
    import os
    import subprocess
    import sys
    from functools import partial

    from tests.helpers.side_by_side import side_by_side

    script = (
        "import warnings; warnings.simplefilter('default'); import lightning_rec; "
        "warnings.warn('`torch.distributed.reduce_scatter_tensor` is deprecated', FutureWarning)"
    )
    cases = {"1": True, "": False}  # LIGHTNING_REC_ALL_WARNINGS -> the warning shown
    jobs = {
        value: partial(
            subprocess.run,
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env={**os.environ, "LIGHTNING_REC_ALL_WARNINGS": value},
            timeout=120,
        )
        for value in cases
    }
    with side_by_side(jobs) as runs:  # both at once: each process spends its time importing, on one core
        for value, shown in cases.items():
            out = runs[value].result()
            assert out.returncode == 0, out.stderr
            assert ("reduce_scatter_tensor` is deprecated" in out.stderr) is shown, (value, out.stderr[-2000:])
