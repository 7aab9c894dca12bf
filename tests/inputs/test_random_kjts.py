"""Property-based (hypothesis): random, mostly malformed KeyedJaggedTensors thrown at a real 1-process fit each
train one correct step (checked against a hand computation) or are refused with an InputError that changes nothing.
The fit's plan and the weight comparison are ``test_inputs.py``'s.

The scenario (what the rank runs) is at the end of this module."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec import Batch
from lightning_rec.errors import InputError
from tests.helpers.dist import run_ranks
from tests.helpers.models import GENRES, ITEMS, USERS, RecModel, assemble, local_weights, make_batches
from tests.helpers.scenarios import make_trainer
from tests.inputs.test_inputs import ONE_TABLE_PLAN
from tests.inputs.test_inputs import same_weights as _same  # one_step's source seeds hypothesis (derandomize): keep it


@pytest.mark.dist
def test_random_malformed_kjts_give_a_correct_step_or_a_clear_error(tmp_path):
    """Property-based (hypothesis): in a real 1-process fit, every random KJT either trains one correct step (its
    loss equals a hand computation from the weights before it) or raises an InputError and changes nothing; valid
    ones are never refused. It runs in its own process: an interpreter crash or a hang fails the test."""
    outcomes = run_ranks(fuzz_kjts, 1, tmp_path, timeout=400, max_examples=80)[0]
    assert outcomes["trained"] >= 5 and outcomes["refused"] >= 20 and outcomes["empty"] >= 1, outcomes


# ------------------------------------------------------------------------------------------------------------
# Property-based: random (mostly malformed) KeyedJaggedTensors thrown at a 1-process fit.
# ------------------------------------------------------------------------------------------------------------

TABLE_ROWS = {"user": USERS, "item": ITEMS, "genre": GENRES}


def _kjt_cases():
    """A hypothesis strategy of ``(kjt, defects)``: a KJT for RecModel's EBC and the defects it was built with
    (an empty one is valid)."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw):
        defects: list[str] = []
        batch = draw(st.integers(0, 5))  # 0: an empty batch, which trains (nothing flows back from it)
        keys = draw(st.permutations(list(TABLE_ROWS)))
        change = draw(st.sampled_from(["none"] * 6 + ["drop", "unknown", "duplicate"]))
        if change == "drop":
            keys = keys[:-1]
            defects.append("missing feature")
        elif change == "unknown":  # a feature no table reads: valid (as in TorchRec, the module ignores it)
            keys = keys + ["age"]
        elif change == "duplicate":
            keys = keys + [keys[0]]
            defects.append("duplicate feature")
        lengths = [draw(st.integers(0, 3)) for _ in range(batch * len(keys))]
        values: list[int] = []
        feature_of: list[str] = []  # the feature of each value
        for k, key in enumerate(keys):
            rows = TABLE_ROWS.get(key, 10)
            for n in lengths[k * batch : (k + 1) * batch]:
                values += [draw(st.integers(0, rows - 1)) for _ in range(n)]
                feature_of += [key] * n
        if values and draw(st.booleans()) and draw(st.booleans()):
            i = draw(st.integers(0, len(values) - 1))
            values[i] = draw(st.sampled_from([-1, -(2**31), 10**9, 2**40])) if draw(st.booleans()) else values[i] + 100
            # 100+ is outside every table here; ids of "age" have no table to be outside of
            if feature_of[i] in TABLE_ROWS and not 0 <= values[i] < 10:
                defects.append("id out of range")
        if lengths and draw(st.integers(0, 5)) == 0:
            i = draw(st.integers(0, len(lengths) - 1))
            delta = draw(st.sampled_from([-5, -1, 1, 2]))
            lengths[i] += delta
            defects.append("negative length" if lengths[i] < 0 else "lengths do not add up")
        if draw(st.integers(0, 7)) == 0 and (lengths or draw(st.booleans())):
            lengths = lengths + [0] if not lengths or draw(st.booleans()) else lengths[:-1]
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
        assert not defects, (
            f"a batch with defects {defects} was trained on: {kjt.keys()} {kjt.lengths()} {kjt.values()}"
        )
        if batch_size == 0:  # its loss is a mean over nothing; no gradient, no change
            assert math.isnan(model.losses[-1]) and _same(before, local_weights(model))
            outcomes["empty"] = outcomes.get("empty", 0) + 1
            return
        expected = _expected_loss(assemble([before]), kjt, batch.dense_features, batch.labels)
        assert math.isclose(model.losses[-1], expected, rel_tol=1e-5, abs_tol=1e-6), (
            model.losses[-1],
            expected,
            kjt.keys(),
            kjt.values(),
            kjt.lengths(),
            kjt.weights_or_none(),
        )
        # A correct step trains, unless the model already fits the batch (a loss near 0: updates below float resolution)
        assert model.losses[-1] < 1e-6 or not _same(before, local_weights(model)), "a correct step trains"
        outcomes["trained"] = outcomes.get("trained", 0) + 1

    one_step()
    return outcomes
