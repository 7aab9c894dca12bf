"""Bad input gets a clear error naming what is wrong, raised before anything is updated; what TorchRec would get
silently wrong (feature order, weights on unweighted tables, batches of different sizes per rank) is handled."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec import Batch
from lightning_rec._inputs.checks import InputChecks, check_finite
from lightning_rec._inputs.kjt import check_features
from lightning_rec._inputs.specs import FeatureTables, ModuleInputs
from lightning_rec.errors import InputError, NonFiniteError
from tests.helpers import checkpoint_scenarios, scenarios
from tests.helpers.checkpoint_scenarios import optimizer_sums
from tests.helpers.dist import launch, run_ranks
from tests.helpers.models import GENRES, ITEMS, USERS, RecModel, assemble, local_weights, make_batches
from tests.helpers.scenarios import make_trainer

SPEC = ModuleInputs("ebc", ("user", "genre"), {"user": ("t_user", 10), "genre": ("t_genre", 5)})


def _check(where: str = "training step 3 (epoch 0, batch 3)", spec: ModuleInputs = SPEC, **kjt) -> KeyedJaggedTensor:
    return check_features(KeyedJaggedTensor(**kjt), spec, where=where)


# ------------------------------------------------------------------------------------------------------------
# A batch may carry features other modules read; each module reads its own.
# ------------------------------------------------------------------------------------------------------------


def test_a_module_reads_its_own_features_of_a_shared_kjt_and_a_missing_one_is_an_error():
    kjt = dict(
        keys=["item", "genre", "user"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1, 0, 0])
    )
    out = _check(**kjt)
    assert out.keys() == ["user", "genre"]  # the module's features, in its order; 'item' is another module's
    assert out["user"].values().tolist() == [] and out["genre"].values().tolist() == [3, 4]
    with pytest.raises(
        InputError, match=r"lacks feature\(s\) \['genre'\] \(table 't_genre'\); it has \['item', 'user'\]"
    ):
        _check(keys=["item", "user"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1, 0, 0]))
    # Ids are still checked against the table that reads them, not the other features'.
    with pytest.raises(
        InputError, match=r"feature 'genre' \(table 't_genre', 5 rows\) has 1 id\(s\) outside \[0, 5\): 7"
    ):
        _check(
            keys=["item", "genre", "user"], values=torch.tensor([99, 7, 1]), lengths=torch.tensor([1, 0, 1, 0, 1, 0])
        )


def test_a_feature_no_table_of_the_model_reads_is_named_once_in_a_warning():
    checks = InputChecks(check_ids=True, nonfinite="error", position=lambda ahead, batch=None: "")
    checks.tables = FeatureTables.of({"ebc": SPEC})
    kjt = KeyedJaggedTensor(
        keys=["user", "genre", "agee"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1])
    )
    with pytest.warns(UserWarning, match=r"batch\['sparse'\] carries feature\(s\) \['agee'\] that no embedding table"):
        checks.check_host({"sparse": kjt})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next batch is not warned about again
        checks.check_host({"sparse": kjt})


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
    "empty": "InputError: training step 3 (epoch 0, batch 3): module 'ebc': the batch has no samples (stride 0).",
    "nan_dense": "NonFiniteError: training step 3 (epoch 0, batch 3): the dense input batch.dense_features has 1 "
    "NaN/infinite value(s), e.g. nan at index (3, 1). Nothing was updated with this batch.",
}


@pytest.mark.dist
def test_each_bad_batch_fails_at_its_step_naming_what_is_wrong_and_changes_nothing(tmp_path):
    results = run_ranks(
        bad_batches,
        1,
        tmp_path,
        cases=list(EXPECTED_ERRORS) + ["none", "permuted", "int32_ids", "unknown_feature"],
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


@pytest.mark.dist
def test_random_malformed_kjts_give_a_correct_step_or_a_clear_error(tmp_path):
    """Property-based (hypothesis): in a real 1-process fit, every random KJT either trains one correct step (its
    loss equals a hand computation from the weights before it) or raises an InputError and changes nothing; valid
    ones are never refused. It runs in its own process: an interpreter crash or a hang fails the test."""
    outcomes = run_ranks(fuzz_kjts, 1, tmp_path, timeout=400, max_examples=80)[0]
    assert outcomes["trained"] >= 5 and outcomes["refused"] >= 20, outcomes


# ------------------------------------------------------------------------------------------------------------
# The checks themselves, in one process.
# ------------------------------------------------------------------------------------------------------------


def test_offsets_only_and_feature_order():
    out = _check(keys=["genre", "user"], values=torch.tensor([4, 1, 7, 8]), offsets=torch.tensor([0, 1, 2, 3, 4]))
    assert out.keys() == ["user", "genre"] and out.values().tolist() == [7, 8, 4, 1]
    with pytest.raises(InputError, match=r"offsets must start at 0 and end at the number of values \(4\), got first=1"):
        _check(keys=["user", "genre"], values=torch.tensor([4, 1, 7, 8]), offsets=torch.tensor([1, 1, 2, 3, 4]))
    with pytest.raises(InputError, match="lengths and offsets disagree"):
        _check(
            keys=["user", "genre"],
            values=torch.tensor([4, 1, 3, 2]),
            lengths=torch.tensor([1, 1, 1, 1]),
            offsets=torch.tensor([0, 2, 2, 3, 4]),
        )


@pytest.mark.parametrize(
    "kjt, message",
    [
        (
            dict(keys=["user", "user"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1])),
            r"lacks feature\(s\) \['genre'\] \(table 't_genre'\) and has duplicated feature\(s\) \['user'\]",
        ),
        (
            dict(keys=["user", "genre"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]), stride=2),
            r"the batch size \(stride\) is 2 but the lengths hold 1 samples per feature",
        ),
        (
            dict(keys=["user", "genre"], values=torch.tensor([[1, 2]]), lengths=torch.tensor([1, 1])),
            r"values must be a 1-D tensor of int32/int64 ids, got a 2-D torch.int64 tensor",
        ),
        (
            dict(keys=["user", "genre"], values=torch.tensor([1, 2]), lengths=torch.tensor([2, -1, 1, 0])),
            r"lengths must be >= 0, got -1 at position 1 \(feature 'user', sample 1\)",
        ),
        (
            dict(keys=["user", "genre"], values=torch.tensor([1, 5, 9]), lengths=torch.tensor([1, 0, 1, 1])),
            r"feature 'genre' \(table 't_genre', 5 rows\) has 2 id\(s\) outside \[0, 5\): 5 \(sample 0\), min 5, max 9",
        ),
        (
            dict(
                keys=["user", "genre"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]), weights=torch.ones(2)
            ),
            r"carries per-id weights but the module's tables are unweighted",
        ),
    ],
)
def test_malformed_kjts_are_named(kjt, message):
    with pytest.raises(InputError, match=r"^training step 3 \(epoch 0, batch 3\): module 'ebc': .*" + message):
        _check(**kjt)


def test_weighted_tables_need_finite_weights():
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
        is_weighted=True,
        device=torch.device("meta"),
    )
    spec = ModuleInputs.of("ebc", ebc)
    assert spec.weighted and spec.tables == {"f": ("t", 10)}
    ok = dict(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([2]))
    assert _check(spec=spec, weights=torch.tensor([0.5, 1.0]), **ok).weights().tolist() == [0.5, 1.0]
    with pytest.raises(InputError, match="weighted .* carries no weights"):
        _check(spec=spec, **ok)
    with pytest.raises(InputError, match="weights must be finite, got nan at position 1"):
        _check(spec=spec, weights=torch.tensor([0.5, math.nan]), **ok)
    with pytest.raises(InputError, match=r"one weight per id \(2\), got torch.float32 of shape \(3,\)"):
        _check(spec=spec, weights=torch.ones(3), **ok)


def test_not_a_kjt():
    with pytest.raises(
        InputError, match=r"module 'ebc': expected a KeyedJaggedTensor of features \['user', 'genre'\], got Tensor"
    ):
        check_features(torch.zeros(3), SPEC)


def test_nonfinite_policies():
    assert check_finite(torch.ones(3), "x") is None
    assert check_finite(torch.tensor([[1.0], [math.inf]]), "the loss", "step 2") == (
        "step 2: the loss has 1 NaN/infinite value(s), e.g. inf at index (1, 0)."
    )
    batch = {"dense": torch.tensor([1.0, math.nan]), "ids": torch.tensor([1, 2]), "nested": [torch.zeros(1)]}
    with pytest.raises(NonFiniteError, match=r"^at step 7: the dense input batch\['dense'\] has 1 NaN"):
        InputChecks(True, "error", position=lambda ahead: "at step 7").check_host(batch)
    warn = InputChecks(True, "warn", position=lambda ahead: "step 2")
    warn.check_loss(torch.tensor(math.nan))  # read one step late
    with pytest.warns(UserWarning, match="^step 2: the loss is nan. Training goes on"):
        warn.check_loss(torch.tensor(1.0))
    error = InputChecks(True, "error", position=lambda ahead: "step 5")
    error.check_loss(torch.tensor([1.0, math.inf]))
    with pytest.raises(NonFiniteError, match="^step 5: the loss is inf. It was found after that step's update"):
        error.poll()
    error.poll()  # reported once
    with pytest.raises(NonFiniteError, match="Nothing was updated with this batch"):
        InputChecks(True, "strict", position=lambda ahead: "").check_loss(torch.tensor(math.nan))
    InputChecks(True, "ignore", position=lambda ahead: "").check_loss(torch.tensor(math.nan))
    with pytest.raises(ValueError, match="nonfinite must be"):
        InputChecks(True, "skip", position=lambda ahead: "")  # type: ignore[arg-type]


def test_bounds_check_none_takes_the_checks_away_and_error_puts_them_back():
    """One sharded module, trainers with different settings: `install` wraps `input_dist` once and unwraps it."""
    from torch import nn
    from torchrec.distributed.types import ShardedModule

    class Sharded(ShardedModule):  # the least a TorchRec sharded module is
        def __init__(self) -> None:
            super().__init__()

        def input_dist(self, ctx, features):
            return features

        def create_context(self):
            return None

        def compute(self, ctx, dist_input):
            return dist_input

        def output_dist(self, ctx, output):
            return output

        @property
        def unsharded_module_type(self):
            return nn.Module

    root = nn.Module()
    root.ebc = Sharded()
    bad = KeyedJaggedTensor(keys=["user", "genre"], values=torch.tensor([1, 50]), lengths=torch.tensor([1, 1]))
    checks = {
        mode: InputChecks(mode == "error", "error", lambda ahead: "", check_structure=mode != "none")
        for mode in ("error", "none")
    }
    checks["error"].install(root, {"ebc": SPEC})
    checks["error"].install(root, {"ebc": SPEC})  # idempotent: one wrapper, not two
    with pytest.raises(InputError, match="feature 'genre'"):
        root.ebc.input_dist(None, bad)
    checks["none"].install(root, {"ebc": SPEC})
    assert "input_dist" not in vars(root.ebc) and root.ebc.input_dist(None, bad) is bad
    checks["error"].install(root, {"ebc": SPEC})
    with pytest.raises(InputError):
        root.ebc.input_dist(None, bad)


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


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
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
        "weights_unchanged": _same(snapshots.weights, local_weights(model)),
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
        "weights_unchanged": _same(snapshots.weights, local_weights(model)),
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


# ------------------------------------------------------------------------------------------------------------
# Property-based: random (mostly malformed) KeyedJaggedTensors thrown at a 1-process fit.
# ------------------------------------------------------------------------------------------------------------

TABLE_ROWS = {"user": USERS, "item": ITEMS, "genre": GENRES}


def _kjt_cases():
    """A hypothesis strategy of ``(kjt, defects)``: a KJT for RecModel's EBC and the defects it was built with
    (empty: a valid batch)."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw):
        defects: list[str] = []
        batch = draw(st.integers(0, 5))
        if batch == 0:
            defects.append("empty")
        keys = draw(st.permutations(list(TABLE_ROWS)))
        change = draw(st.sampled_from(["none"] * 6 + ["drop", "unknown", "duplicate"]))
        if change == "drop":
            keys = keys[:-1]
            defects.append("missing feature")
        elif change == "unknown":
            keys = keys + ["age"]
            defects.append("unknown feature")
        elif change == "duplicate":
            keys = keys + [keys[0]]
            defects.append("duplicate feature")
        lengths = [draw(st.integers(0, 3)) for _ in range(batch * len(keys))]
        values: list[int] = []
        for k, key in enumerate(keys):
            rows = TABLE_ROWS.get(key, 10)
            for n in lengths[k * batch : (k + 1) * batch]:
                values += [draw(st.integers(0, rows - 1)) for _ in range(n)]
        if values and draw(st.booleans()) and draw(st.booleans()):
            i = draw(st.integers(0, len(values) - 1))
            values[i] = draw(st.sampled_from([-1, -(2**31), 10**9, 2**40])) if draw(st.booleans()) else values[i] + 100
            if not 0 <= values[i] < 10:  # ids of "age" have no table; 100+ is outside every table here
                defects.append("id out of range")
        if lengths and draw(st.integers(0, 5)) == 0:
            i = draw(st.integers(0, len(lengths) - 1))
            delta = draw(st.sampled_from([-5, -1, 1, 2]))
            lengths[i] += delta
            defects.append("negative length" if lengths[i] < 0 else "lengths do not add up")
        if draw(st.integers(0, 7)) == 0:
            lengths = lengths + [0] if draw(st.booleans()) else lengths[:-1]
            defects.append("lengths count")
        values_dtype = draw(st.sampled_from([torch.int64] * 4 + [torch.int32, torch.float32, torch.int16]))
        lengths_dtype = draw(st.sampled_from([torch.int32, torch.int64]))  # KJT's constructor refuses float lengths
        if values_dtype not in (torch.int32, torch.int64):
            defects.append("dtype")
        limit = {torch.int32: 2**31, torch.int16: 2**15}.get(values_dtype)
        if limit is not None and any(not -limit <= v < limit for v in values):
            values_dtype = torch.int64
        kwargs: dict[str, Any] = {}
        weights_kind = draw(st.sampled_from(["none"] * 4 + ["ok", "short"]))
        if weights_kind != "none":
            kwargs["weights"] = torch.rand(len(values) + (weights_kind == "short"))
            defects.append("weights on unweighted tables")
        if draw(st.integers(0, 7)) == 0:
            kwargs["stride"] = batch + 1
            defects.append("stride")
        kjt = KeyedJaggedTensor(
            keys=keys,
            values=torch.tensor(values, dtype=values_dtype),
            lengths=torch.tensor(lengths, dtype=lengths_dtype),
            **kwargs,
        )
        return kjt, batch, sorted(set(defects))

    return build()


def _expected_loss(
    weights: dict[str, torch.Tensor], kjt: KeyedJaggedTensor, dense: torch.Tensor, labels: torch.Tensor
) -> float:
    """The loss RecModel must compute on a valid batch, from its weights before the step, by hand."""
    import torch.nn.functional as F

    parts = []
    by_key = kjt.to_dict()
    for feature in TABLE_ROWS:
        jt = by_key[feature]
        table = weights[f"ebc.embedding_bags.t_{feature}.weight"]
        parts.append(F.embedding_bag(jt.values().long(), table, jt.offsets()[:-1].long(), mode="sum"))
    x = torch.cat(parts + [dense], dim=1)
    h = F.relu(F.linear(x, weights["mlp.0.weight"], weights["mlp.0.bias"]))
    logits = F.linear(h, weights["mlp.2.weight"], weights["mlp.2.bias"]).squeeze(1)
    return float(F.binary_cross_entropy_with_logits(logits, labels))


def fuzz_kjts(rank: int, world_size: int, out_dir: Path, max_examples: int = 60) -> dict[str, Any]:
    """Every random KJT either trains one correct step (the loss equals the hand-computed one) or is refused with
    an InputError that leaves every weight as it was; valid ones are never refused, malformed ones never trained on.
    Hypothesis shrinks and prints any counterexample; a crash of the interpreter fails the process."""
    from hypothesis import given, settings

    L.seed_everything(0)
    model = RecModel(lr=0.05)
    make_trainer(world_size, 1, {"constraints": ONE_TABLE_PLAN}).fit(
        model, DataLoader(make_batches(1, 4, seed=0), batch_size=None)
    )
    outcomes: dict[str, int] = {}

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None)
    @given(case=_kjt_cases())
    def one_step(case) -> None:
        kjt, batch_size, defects = case
        g = torch.Generator().manual_seed(batch_size)
        batch = Batch(
            dense_features=torch.rand(batch_size, 2, generator=g),
            sparse_features=kjt,
            labels=(torch.rand(batch_size, generator=g) > 0.5).float(),
        )
        before = local_weights(model)
        try:
            make_trainer(world_size, 1, {"constraints": ONE_TABLE_PLAN}, det_init=False).fit(
                model, DataLoader([batch], batch_size=None)
            )
        except InputError as e:
            assert defects, f"a valid batch was refused: {e}"
            assert "training step 0 (epoch 0, batch 0): module 'ebc': " in str(e), str(e)
            assert _same(before, local_weights(model)), "a refused batch changed the weights"
            outcomes["refused"] = outcomes.get("refused", 0) + 1
            return
        assert not defects, f"a batch with defects {defects} was trained on"
        expected = _expected_loss(assemble([before]), kjt, batch.dense_features, batch.labels)
        assert math.isclose(model.losses[-1], expected, rel_tol=1e-5, abs_tol=1e-6), (
            model.losses[-1],
            expected,
            kjt.keys(),
            kjt.values(),
            kjt.lengths(),
            kjt.weights_or_none(),
        )
        assert not _same(before, local_weights(model)), "a correct step trains"
        outcomes["trained"] = outcomes.get("trained", 0) + 1

    one_step()
    return outcomes
