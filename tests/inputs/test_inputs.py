"""Bad input gets a clear error naming what is wrong, raised before anything is updated; what TorchRec would get
silently wrong (feature order, weights on unweighted tables, batches of different sizes per rank) is handled."""

from __future__ import annotations

import math

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec._inputs.checks import InputChecks, check_finite
from lightning_rec._inputs.kjt import check_features
from lightning_rec._inputs.specs import FeatureTables, ModuleInputs
from lightning_rec.errors import InputError, NonFiniteError
from tests.helpers import checkpoint_scenarios, input_scenarios, scenarios
from tests.helpers.dist import launch, run_ranks

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
        input_scenarios.bad_batches,
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
    late = run_ranks(input_scenarios.bad_batches, 1, tmp_path, cases=["overflowing_dense"])[0]["overflowing_dense"]
    assert late["error"].startswith(
        "NonFiniteError: training step 3 (epoch 0, batch 3): the loss is inf. It was found after that step's update"
    ), late["error"]
    assert "nonfinite='strict'" in late["error"] and late["steps_done"] == 4  # step 3 updated, step 4 refused
    assert math.isinf(late["losses"][3])
    strict = run_ranks(
        input_scenarios.bad_batches, 1, tmp_path, cases=["overflowing_dense"], strategy={"nonfinite": "strict"}
    )[0]
    strict = strict["overflowing_dense"]
    assert strict["error"].startswith(
        "NonFiniteError: training step 3 (epoch 0, batch 3): the loss has 1 NaN/infinite value(s), e.g. inf at index (). "
        "Nothing was updated with this batch."
    ), strict["error"]
    assert strict["steps_done"] == 3 and strict["weights_unchanged"] and strict["optimizer_unchanged"]


@pytest.mark.dist
def test_a_non_finite_loss_at_the_last_step_fails_the_fit_and_no_checkpoint_holds_it(tmp_path):
    """The last step's loss is read before `fit` returns, and before any checkpoint is written after it."""
    results = run_ranks(input_scenarios.nan_loss_at_end, 1, tmp_path)[0]
    for case in ("error", "error_without_checkpoints"):
        assert results[case].startswith("NonFiniteError: training step 5 (epoch 0, batch 5): the loss is inf."), results
    assert results["checkpoints"] == ["step=3.ckpt"], results  # after step 2; the one after step 5 was refused


@pytest.mark.dist
@pytest.mark.parametrize("how, door_reads", [("rebuilt", 4), ("in_place", 1)])
def test_ids_the_host_never_saw_are_checked_at_the_tables_door(tmp_path, how, door_reads):
    """A KJT rebuilt inside ``forward``, or the batch's own changed in place there, is read at the module's door
    (a host sync on a GPU, only for such KJTs): the same error at the same step, nothing updated."""
    result = run_ranks(input_scenarios.ids_changed_in_forward, 1, tmp_path, how=how)[0]
    assert result["error"].startswith(EXPECTED_ERRORS["id_too_large"]), result["error"]
    assert result["steps_done"] == 3 and result["weights_unchanged"] and result["optimizer_unchanged"]
    assert result["door_reads"] == door_reads  # rebuilt: every step; in place: only the step that changed it


@pytest.mark.dist
def test_pipelined_training_refuses_a_bad_batch_before_its_step(tmp_path):
    results = run_ranks(
        input_scenarios.bad_batches, 1, tmp_path, cases=["id_too_large", "nan_dense"], strategy={"pipeline": True}
    )[0]
    for case in ("id_too_large", "nan_dense"):
        assert results[case]["error"].startswith(EXPECTED_ERRORS[case]), results[case]["error"]
        assert results[case]["weights_unchanged"] and results[case]["optimizer_unchanged"]
    # Batches are checked on the host as the pipeline fetches them, a step ahead: step 2 stops too.
    assert results["id_too_large"]["steps_done"] == 2
    assert results["nan_dense"]["steps_done"] == 2


@pytest.mark.dist
def test_warn_modes_train_on(tmp_path):
    results = run_ranks(
        input_scenarios.bad_batches,
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
    outcomes = run_ranks(input_scenarios.fuzz_kjts, 1, tmp_path, timeout=400, max_examples=80)[0]
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
