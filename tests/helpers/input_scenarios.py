"""Malformed batches thrown at real fits (tests/inputs/test_inputs.py). Each scenario returns a JSON-able dict."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec import Batch
from tests.helpers.checkpoint_scenarios import optimizer_sums
from tests.helpers.models import GENRES, ITEMS, USERS, RecModel, local_weights, make_batches
from tests.helpers.scenarios import make_trainer

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

    from lightning_rec.errors import InputError
    from tests.helpers.models import assemble

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
