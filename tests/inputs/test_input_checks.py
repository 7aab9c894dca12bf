"""The input checks themselves, in one process, on hand-built KeyedJaggedTensors: each module reads its own features
of a shared KJT (reordered to its tables), malformed KJTs (structure, dtypes, lengths/offsets, ids outside their
table, weights) are named with the module, feature, table, id and sample, non-finite dense inputs and losses follow
the ``nonfinite`` policy, and ``bounds_check`` installs or removes the check at the tables' door. Real fits with bad
batches are in ``test_inputs.py``; random KJTs thrown at a fit in ``test_random_kjts.py``."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec._inputs.checks import InputChecks, check_finite
from lightning_rec._inputs.kjt import check_features
from lightning_rec._inputs.specs import FeatureTables, ModuleInputs
from lightning_rec.errors import InputError, NonFiniteError

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
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next batch is not warned about again
        checks.check_host({"sparse": kjt})


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


def test_batches_made_under_inference_mode_are_predicted_and_still_checked(tmp_path):
    """``trainer.predict`` runs under ``torch.inference_mode``: on a GPU the batch it copies is an inference tensor,
    which keeps no version counter (the input checks' trust of a host-checked batch read it and failed there). On CPU
    the same happens to batches a loader makes under inference mode; a bad id is still refused at the door."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_rec import RecShardStrategy
    from lightning_rec.testing import QUIET_TRAINER
    from tests.helpers.models import RecModel, make_batches

    with torch.inference_mode():
        batches = [b.to("cpu") for b in make_batches(3, 8, seed=0)]
    assert batches[0].sparse_features.values().is_inference()
    L.seed_everything(0)
    model = RecModel()
    trainer = L.Trainer(strategy=RecShardStrategy(), accelerator="cpu", devices=1, **QUIET_TRAINER)
    out = trainer.predict(model, DataLoader(batches, batch_size=None))
    assert len(out) == 3 and all(torch.isfinite(o).all() for o in out)
    with torch.inference_mode():
        bad = make_batches(1, 8, seed=1)[0].to("cpu")
        bad.sparse_features.values()[0] = 10**6
    with pytest.raises(InputError, match="1000000"):
        trainer.predict(model, DataLoader([bad], batch_size=None))
