"""Bad input in real fits gets a clear error naming what is wrong, raised before anything is updated: every kind of
bad batch at its step (on the host, at the tables' door for ids changed in ``forward``, a step ahead when pipelined,
on one rank of two), non-finite losses (a step late by default, before the update when strict, at the last step
before any checkpoint) and the ``warn`` modes; what TorchRec would get silently wrong (feature order, batches of
different sizes per rank) is handled. The checks on hand-built KJTs are in ``test_input_checks.py``; random KJTs in
``test_random_kjts.py``.

The scenarios (what each rank runs) are at the end of this module."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec import Batch
from tests.helpers import checkpoint_scenarios, scenarios
from tests.helpers.checkpoint_scenarios import optimizer_sums
from tests.helpers.dist import launch, run_ranks
from tests.helpers.models import USERS, RecModel, local_weights, make_batches
from tests.helpers.scenarios import make_trainer

# ------------------------------------------------------------------------------------------------------------
# Real fits: every kind of bad batch, at step 3 of a 1-process fit.
# ------------------------------------------------------------------------------------------------------------

EXPECTED_ERRORS = {
    "id_too_large": "InputError: training step 3 (epoch 0, batch 3): module 'ebc': feature 'user' (table 't_user', 60 "
    "rows) has 1 id(s) outside [0, 60): 65 (sample 1).",
    "negative_id": "InputError: training step 3 (epoch 0, batch 3): module 'ebc': feature 'item' (table 't_item', 80 "
    "rows) has 1 id(s) outside [0, 80): -3 (sample 0).",
    "missing_feature": "InputError: training step 3 (epoch 0, batch 3): module 'ebc': the KeyedJaggedTensor lacks "
    "feature(s) ['genre'] (table 't_genre'); it has ['user', 'item'], the module expects ['user', 'item', 'genre'].",
    "lengths_mismatch": "InputError: training step 3 (epoch 0, batch 3): module 'ebc': the lengths add up to 49 ids "
    "but there are 48 values.",
    "float_values": "InputError: training step 3 (epoch 0, batch 3): module 'ebc': values must be a 1-D tensor of "
    "int32/int64 ids, got a 1-D torch.float32 tensor.",
    "nan_dense": "NonFiniteError: training step 3 (epoch 0, batch 3): the dense input batch.dense_features has 1 "
    "NaN/infinite value(s), e.g. nan at index (3, 1). Nothing was updated with this batch.",
}


@pytest.mark.dist
def test_each_bad_batch_fails_at_its_step_naming_what_is_wrong_and_changes_nothing(tmp_path):
    results = run_ranks(
        bad_batches,
        1,
        tmp_path,
        cases=list(EXPECTED_ERRORS) + ["none", "permuted", "int32_ids", "unknown_feature", "empty"],
    )[0]
    for case, expected in EXPECTED_ERRORS.items():
        r = results[case]
        assert r["error"] is not None and r["error"].startswith(expected), (case, r["error"])
        assert r["steps_done"] == 3, case  # steps 0-2 trained, the bad step 3 did not
        assert r["weights_unchanged"] and r["optimizer_unchanged"], f"{case}: the refused step changed state"
    assert "HINT" in results["id_too_large"]["error"] and "bounds_check='warn'" in results["id_too_large"]["error"]
    # Features in another order than the module's, int32 ids, and a feature no table reads beside the module's
    # (each module reads its own features, as in TorchRec) are the same batch: the same losses.
    good = results["none"]
    assert good["error"] is None and len(good["losses"]) == 6
    for case in ("permuted", "int32_ids", "unknown_feature"):
        assert results[case]["error"] is None
        assert results[case]["losses"] == good["losses"], case
    # An empty batch (no samples: TorchRec trains it) is not refused; its loss is a mean over nothing, the rest trains on.
    empty = results["empty"]
    assert empty["error"] is None and len(empty["losses"]) == 6 and math.isnan(empty["losses"][3])
    assert empty["losses"][:3] == good["losses"][:3]


@pytest.mark.dist
def test_a_non_finite_loss_is_named_a_step_late_by_default_and_refused_before_its_update_when_strict(tmp_path):
    """Dense inputs so large that the loss overflows to inf at step 3. By default the loss is read one step late
    (no host sync): step 4's backward is refused, naming step 3; "strict" refuses step 3 itself."""
    late = run_ranks(bad_batches, 1, tmp_path, cases=["overflowing_dense"])[0]["overflowing_dense"]
    assert late["error"].startswith(
        "NonFiniteError: training step 3 (epoch 0, batch 3): the loss is inf. It was found after that step's update"
    ), late["error"]
    assert "nonfinite='strict'" in late["error"] and late["steps_done"] == 4  # step 3 updated, step 4 refused
    assert math.isinf(late["losses"][3])
    strict = run_ranks(bad_batches, 1, tmp_path, cases=["overflowing_dense"], strategy={"nonfinite": "strict"})[0]
    strict = strict["overflowing_dense"]
    assert strict["error"].startswith(
        "NonFiniteError: training step 3 (epoch 0, batch 3): the loss has 1 NaN/infinite value(s), e.g. inf at index (). "
        "Nothing was updated with this batch."
    ), strict["error"]
    assert strict["steps_done"] == 3 and strict["weights_unchanged"] and strict["optimizer_unchanged"]


@pytest.mark.dist
def test_a_non_finite_loss_at_the_last_step_fails_the_fit_and_no_checkpoint_holds_it(tmp_path):
    """The last step's loss is read before `fit` returns, and before any checkpoint is written after it."""
    results = run_ranks(nan_loss_at_end, 1, tmp_path)[0]
    for case in ("error", "error_without_checkpoints"):
        assert results[case].startswith("NonFiniteError: training step 5 (epoch 0, batch 5): the loss is inf."), results
    assert results["checkpoints"] == ["step=3.ckpt"], results  # after step 2; the one after step 5 was refused


@pytest.mark.dist
@pytest.mark.parametrize("how, door_reads", [("rebuilt", 4), ("in_place", 1)])
def test_ids_the_host_never_saw_are_checked_at_the_tables_door(tmp_path, how, door_reads):
    """A KJT rebuilt inside ``forward``, or the batch's own changed in place there, is read at the module's door
    (a host sync on a GPU, only for such KJTs): the same error at the same step, nothing updated."""
    result = run_ranks(ids_changed_in_forward, 1, tmp_path, how=how)[0]
    assert result["error"].startswith(EXPECTED_ERRORS["id_too_large"]), result["error"]
    assert result["steps_done"] == 3 and result["weights_unchanged"] and result["optimizer_unchanged"]
    assert result["door_reads"] == door_reads  # rebuilt: every step; in place: only the step that changed it


@pytest.mark.dist
def test_pipelined_training_refuses_a_bad_batch_before_its_step(tmp_path):
    results = run_ranks(bad_batches, 1, tmp_path, cases=["id_too_large", "nan_dense"], strategy={"pipeline": True})[0]
    for case in ("id_too_large", "nan_dense"):
        assert results[case]["error"].startswith(EXPECTED_ERRORS[case]), results[case]["error"]
        assert results[case]["weights_unchanged"] and results[case]["optimizer_unchanged"]
    # Batches are checked on the host as the pipeline fetches them, a step ahead: step 2 stops too.
    assert results["id_too_large"]["steps_done"] == 2
    assert results["nan_dense"]["steps_done"] == 2


@pytest.mark.dist
def test_warn_modes_train_on(tmp_path):
    results = run_ranks(
        bad_batches,
        1,
        tmp_path,
        cases=["id_too_large", "nan_dense"],
        strategy={"bounds_check": "warn", "nonfinite": "warn"},
    )[0]
    ids, nan = results["id_too_large"], results["nan_dense"]
    assert ids["error"] is None and ids["steps_done"] == 6  # TorchRec's own behaviour: the bad id reads row 0
    assert nan["error"] is None and nan["steps_done"] == 6
    assert math.isnan(nan["losses"][3])
    assert any(w.startswith("training step 3 (epoch 0, batch 3): the dense input") for w in nan["warnings"])


@pytest.mark.dist
def test_a_bad_batch_on_one_rank_stops_both_naming_it(tmp_path):
    run = launch(
        checkpoint_scenarios.fit_epochs,
        2,
        tmp_path,
        tag="x",
        epochs=2,
        fail={"rank": 1, "step": 5, "how": "bad_id"},
    )
    rank0, rank1 = run.processes
    bad = (
        "InputError: training step 5 (epoch 1, batch 1): module 'ebc': feature 'user' (table 't_user', 60 rows) has "
        "1 id(s) outside [0, 60): 1000000 (sample 0)."
    )
    assert rank1.returncode != 0 and bad.split(": ", 1)[1] in rank1.log
    assert rank0.returncode not in (0, None)
    assert "because rank 1 failed first: " + bad in rank0.log


@pytest.mark.dist
def test_different_batch_sizes_on_each_rank_train_as_torchrec_does(tmp_path):
    """Rank 0 gets 32 samples per batch, rank 1 gets 7: the same numbers as the hand-written TorchRec loop."""
    ours = run_ranks(scenarios.train, 2, tmp_path, tag="uneven", steps=5, batch_size=[32, 7])
    ref = run_ranks(scenarios.reference, 2, tmp_path, plan_from="uneven", steps=5, batch_size=[32, 7])
    for rank in range(2):
        assert ours[rank]["losses"] == pytest.approx(ref[rank]["losses"], abs=1e-5)


# ------------------------------------------------------------------------------------------------------------
# What each rank runs (run_ranks imports them from this module): malformed batches thrown at real fits. Each
# scenario returns a JSON-able dict.
# ------------------------------------------------------------------------------------------------------------

ONE_TABLE_PLAN = {t: {"sharding_types": ["table_wise"]} for t in ("t_user", "t_item", "t_genre")}


def _kjt(keys: list[str], values: torch.Tensor, lengths: torch.Tensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


def corrupt(batch: Batch, case: str) -> Batch:
    """``batch`` with one defect (``case``), everything else intact."""
    kjt, n = batch.sparse_features, batch.labels.numel()
    keys, values, lengths = list(kjt.keys()), kjt.values().clone(), kjt.lengths().clone()
    dense, labels = batch.dense_features.clone(), batch.labels.clone()
    if case == "id_too_large":
        values[1] = USERS + 5  # sample 1 of "user"
    elif case == "negative_id":
        values[n] = -3  # sample 0 of "item"
    elif case == "missing_feature":
        keys, values, lengths = keys[:2], values[: 2 * n], lengths[: 2 * n]
    elif case == "unknown_feature":
        keys, values, lengths = (
            keys + ["age"],
            torch.cat([values, torch.zeros(n, dtype=values.dtype)]),
            torch.cat([lengths, torch.ones(n, dtype=lengths.dtype)]),
        )
    elif case == "lengths_mismatch":
        lengths[-1] += 1
    elif case == "float_values":
        values = values.float()
    elif case == "empty":
        values, lengths = values[:0], lengths[:0]
        dense, labels = dense[:0], labels[:0]
    elif case == "nan_dense":
        dense[3, 1] = math.nan
    elif case == "overflowing_dense":  # finite inputs whose loss is not
        dense[:] = 3e38
    elif case == "permuted":
        return Batch(dense_features=dense, sparse_features=kjt.permute([2, 0, 1]), labels=labels)
    elif case == "int32_ids":
        values, lengths = values.int(), lengths.long()
    elif case != "none":
        raise ValueError(case)
    return Batch(dense_features=dense, sparse_features=_kjt(keys, values, lengths), labels=labels)


class Snapshots(L.Callback):
    """After every completed step: the weights and optimizer state, and how many steps completed."""

    def __init__(self) -> None:
        self.steps = 0
        self.weights: dict[str, Any] = {}
        self.optimizer: dict[str, float] = {}

    def take(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights = local_weights(pl_module)
        self.optimizer = optimizer_sums(trainer, pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.take(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.steps += 1
        self.take(trainer, pl_module)


def same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two :func:`local_weights` snapshots hold the same tensors, exactly."""
    return a.keys() == b.keys() and all(torch.equal(x[1], y[1]) for k in a for x, y in zip(a[k], b[k]))


def bad_batches(
    rank: int,
    world_size: int,
    out_dir: Path,
    cases: list[str],
    at_step: int = 3,
    steps: int = 6,
    strategy: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """For each case: fit ``steps`` batches, batch ``at_step`` made malformed by the case; report the error (or the
    losses) and whether the failed step changed any weight or optimizer state."""
    return {case: _bad_batch(world_size, case, at_step, steps, strategy) for case in cases}


def _bad_batch(world_size: int, case: str, at_step: int, steps: int, strategy: dict[str, Any] | None) -> dict[str, Any]:
    L.seed_everything(0)
    batches = make_batches(steps, 16, seed=100)
    batches[at_step] = corrupt(batches[at_step], case)
    model = RecModel()
    snapshots = Snapshots()
    trainer = make_trainer(
        world_size, steps, {"constraints": ONE_TABLE_PLAN, **(strategy or {})}, callbacks=[snapshots]
    )
    error: str | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, DataLoader(batches, batch_size=None))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            error = f"{type(e).__name__}: {e}"
    return {
        "error": error,
        "steps_done": snapshots.steps,
        "losses": model.losses,
        "weights_unchanged": same_weights(snapshots.weights, local_weights(model)),
        "optimizer_unchanged": snapshots.optimizer == optimizer_sums(trainer, model),
        "warnings": sorted({str(w.message) for w in caught if "NaN" in str(w.message)}),
    }


class _ChangesIdsInForward(RecModel):
    """Gives the tables a KJT the host never saw: rebuilt from new tensors inside ``forward`` (``how="rebuilt"``), or
    the batch's own, changed in place there (``"in_place"``); at step ``bad_step`` an id of feature 'user' becomes
    too large."""

    def __init__(self, how: str, bad_step: int = 3) -> None:
        super().__init__()
        self.how, self.bad_step = how, bad_step

    def forward(self, batch: Any) -> torch.Tensor:
        kjt = batch.sparse_features
        bad = self.training and self.trainer.global_step == self.bad_step
        if self.how == "rebuilt":
            values = kjt.values().clone()
            if bad:
                values[1] = USERS + 5
            kjt = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths().clone())
        elif bad:
            kjt.values()[1] = USERS + 5
        return super().forward(Batch(dense_features=batch.dense_features, sparse_features=kjt, labels=batch.labels))


def ids_changed_in_forward(rank: int, world_size: int, out_dir: Path, how: str, steps: int = 6) -> dict[str, Any]:
    """Fit :class:`_ChangesIdsInForward`: the error, the completed steps, whether the refused step changed anything,
    and how many KJTs the doors had to read because the host had not checked them."""
    L.seed_everything(0)
    model = _ChangesIdsInForward(how)
    snapshots = Snapshots()
    trainer = make_trainer(world_size, steps, {"constraints": ONE_TABLE_PLAN}, callbacks=[snapshots])
    error = None
    try:
        trainer.fit(model, DataLoader(make_batches(steps, 16, seed=100), batch_size=None))
    except Exception as e:  # noqa: BLE001 - the test inspects it
        error = f"{type(e).__name__}: {e}"
    return {
        "error": error,
        "steps_done": snapshots.steps,
        "door_reads": trainer.strategy._input_checks.door_reads,
        "weights_unchanged": same_weights(snapshots.weights, local_weights(model)),
        "optimizer_unchanged": snapshots.optimizer == optimizer_sums(trainer, model),
    }


def nan_loss_at_end(rank: int, world_size: int, out_dir: Path, steps: int = 6) -> dict[str, Any]:
    """The loss of the last step (5) overflows. A checkpoint every 3 steps: after step 2, and after step 5, which
    must not be written. Then without a checkpoint: `fit` itself must fail."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    result: dict[str, Any] = {}
    for name, callbacks in (
        ("error", [ModelCheckpoint(out_dir / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)]),
        ("error_without_checkpoints", []),
    ):
        L.seed_everything(0)
        batches = make_batches(steps, 16, seed=100)
        batches[-1] = corrupt(batches[-1], "overflowing_dense")
        trainer = make_trainer(world_size, steps, {"constraints": ONE_TABLE_PLAN}, callbacks=callbacks)
        try:
            trainer.fit(RecModel(), DataLoader(batches, batch_size=None))
            result[name] = None
        except Exception as e:  # noqa: BLE001 - the test inspects it
            result[name] = f"{type(e).__name__}: {e}"
    result["checkpoints"] = sorted(p.name for p in (out_dir / "ckpt").iterdir())
    return result
