"""The sharded model behaves like the unsharded one it came from (lightning_rec._strategy.unsharded, dmp.materialize_dense):
same output order under any plan and world size, the rows the tables held, every dense tensor initialised.

The model (tests/helpers/user_models.py) is written as TorchRec's tutorial writes one: tables built on CPU with rows
of their own, ``kt.values()``, dict batches, ``logger=False``; it is compared with plain PyTorch on whole batches.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedTensor

from lightning_rec._strategy.dmp import materialize_dense
from lightning_rec._strategy.unsharded import _Reorder
from lightning_rec.checkpoint import CheckpointError
from tests.helpers import user_scenarios
from tests.helpers.dist import launch, run_ranks
from tests.helpers.models import assemble
from tests.helpers.user_models import (
    REORDERING_PLAN,
    REORDERING_PLAN_SHARDS,
    TABLE_WISE_PLAN,
    ValuesModel,
    samples,
    to_batch,
)

TOL = 1e-5
FIT = user_scenarios.fit


def _mean_losses(results):
    return [sum(r["losses"][i] for r in results) / len(results) for i in range(len(results[0]["losses"]))]


def _logits(results):
    return [x for r in results for x in r["logits"]]


def _start_weights(out: Path, world_size: int):
    return assemble([torch.load(out / f"start.weights{r}.pt", weights_only=False) for r in range(world_size)])


def _check_against_reference(results, out: Path, world_size: int):
    ref = results[0]
    assert _mean_losses(results) == pytest.approx(ref["ref_losses"], abs=TOL)
    assert _logits(results) == pytest.approx(ref["ref_logits"], abs=TOL)
    held, start = torch.load(out / "held.pt"), _start_weights(out, world_size)
    for name, rows in held.items():  # every table and layer starts from what the module held: exactly
        torch.testing.assert_close(start[name], rows, atol=0, rtol=0, msg=name)


@pytest.mark.dist
def test_a_values_model_trains_like_plain_pytorch_on_any_plan_reshards_and_loads(tmp_path):
    two = run_ranks(FIT, 2, tmp_path / "two", constraints=REORDERING_PLAN, save="ckpt")
    one = run_ranks(FIT, 1, tmp_path / "one", constraints=TABLE_WISE_PLAN, save="ckpt")
    # The two plans put the pooled columns in different orders (the 2-rank one differs from the unsharded order
    # and is restored; the table-wise one already agrees and is left alone, at no cost).
    assert [r["reordered"] for r in two] == [True, True] and one[0]["reordered"] is False
    # The column-wise tables are really split (a shard at column 4: its rows are copied from the held columns 4:8).
    assert [r["shards"] for r in two] == [REORDERING_PLAN_SHARDS] * 2
    assert [r["forwards"] for r in (*two, *one)] == [["method"] * 5] * 3, "not pipelined: the modules' own forwards"
    _check_against_reference(two, tmp_path / "two", 2)
    _check_against_reference(one, tmp_path / "one", 1)
    assert one[0]["ref_logits"] == two[0]["ref_logits"]

    # Resharding both ways: a fresh model (other rows) predicts from the other world size's checkpoint.
    for src, ranks, plan in (("two", 1, TABLE_WISE_PLAN), ("one", 2, REORDERING_PLAN)):
        res = run_ranks(
            user_scenarios.predict_from,
            ranks,
            tmp_path / f"{src}-to-{ranks}",
            ckpt=str(tmp_path / src / "ckpt"),
            constraints=plan,
        )
        assert _logits(res) == pytest.approx(two[0]["ref_logits"], abs=TOL), src

    # LightningModule.load_from_checkpoint(<checkpoint dir>): the unsharded model, in this (non-distributed) process.
    model = ValuesModel.load_from_checkpoint(tmp_path / "two" / "ckpt")
    assert model.hparams.seed == 7 and not any(p.is_meta for p in model.parameters())
    with torch.no_grad():
        logits = model(to_batch(samples(16, 99))).tolist()
    assert logits == pytest.approx(two[0]["ref_logits"], abs=TOL)
    with pytest.raises(CheckpointError, match=r"extra.weight: built on meta and not in the checkpoint"):
        _Extra.load_from_checkpoint(tmp_path / "two" / "ckpt", strict=False)  # never uninitialised memory
    # logger=False: no report files, anywhere.
    assert not list(tmp_path.rglob("sharding_plan.*"))


@pytest.mark.dist
def test_pipelined_training_takes_dict_and_tuple_batches(tmp_path):
    dicts = run_ranks(FIT, 2, tmp_path / "dict", constraints=REORDERING_PLAN, pipeline=True)
    _check_against_reference(dicts, tmp_path / "dict", 2)
    tuples = run_ranks(FIT, 1, tmp_path / "tuple", constraints=REORDERING_PLAN, pipeline=True, fmt="tuple")
    _check_against_reference(tuples, tmp_path / "tuple", 1)
    for r in (*dicts, *tuples):
        # Every step on every rank ran TorchRec's pipelined forward (inputs distributed ahead), not a silent
        # fallback to the plain forward, which would match the reference just as well.
        assert r["forwards"] == ["PipelinedForward"] * 5
        assert r["shards"] == REORDERING_PLAN_SHARDS  # 2 column shards per table, on 2 ranks and on 1


@pytest.mark.dist
def test_ranks_holding_different_rows_start_from_rank_zeros(tmp_path):
    """As DDP does for dense layers: every replica and shard starts from rank 0's rows, with a warning."""
    res = run_ranks(FIT, 2, tmp_path, constraints=REORDERING_PLAN, rows_per_rank=True, steps=2)
    _check_against_reference(res, tmp_path, 2)
    assert len(res[0]["warnings"]) == 1 and "ebc.embedding_bags.t_user.weight" in res[0]["warnings"][0]


@pytest.mark.dist
def test_an_embedding_collection_keeps_its_output_order_and_rows(tmp_path):
    res = run_ranks(user_scenarios.ec_order, 1, tmp_path)[0]
    assert res["sharded_keys"] == res["unsharded_keys"] == ["user", "genre", "item"]
    assert res["same_values"]


@pytest.mark.dist
def test_sync_batchnorm_is_applied_like_ddp_does(tmp_path):
    """`Trainer(sync_batchnorm=True)` is not ignored: the BatchNorm layers become SyncBatchNorm before DDP wraps the
    dense part, as under Lightning's ddp, whose DDP then refuses them on CPU with the same error."""
    run = launch(FIT, 2, tmp_path, constraints=REORDERING_PLAN, sync_batchnorm=True, steps=2)
    assert all(p.returncode not in (0, None) for p in run.processes)
    assert all("SyncBatchNorm layers only work with GPU modules" in p.log for p in run.processes)


# ------------------------------------------------------------------------------------------------------------
# The pieces, in one process.
# ------------------------------------------------------------------------------------------------------------


def test_reordering_a_keyed_tensor_keeps_values_and_gradients():
    values = torch.arange(12.0).reshape(2, 6).requires_grad_()
    kt = KeyedTensor(keys=["user", "item", "genre"], length_per_key=[2, 3, 1], values=values)
    out = _Reorder(["user", "genre", "item"])(kt)
    assert out.keys() == ["user", "genre", "item"] and out.length_per_key() == [2, 1, 3]
    for key in kt.keys():
        assert torch.equal(out[key], kt[key])
    weights = torch.arange(6.0)
    (out.values() * weights).sum().backward()
    # Each input column's gradient is the weight of the output column it went to.
    assert values.grad[0].tolist() == [0.0, 1.0, 3.0, 4.0, 5.0, 2.0]
    ec = {"item": 1, "user": 2}
    assert list(_Reorder(["user", "item"])(ec)) == ["user", "item"]


class _Extra(ValuesModel):
    """The model plus a layer on meta that no checkpoint of ValuesModel holds."""

    def __init__(self, seed: int = 7, lr: float = 0.05, fmt: str = "dict", batchnorm: bool = False) -> None:
        super().__init__(seed, lr, fmt, batchnorm)
        self.extra = nn.Linear(2, 2, device="meta")


class _Randn(nn.Module):
    """A BERT4Rec-style parameter made with torch.randn and no reset_parameters."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.randn(5, 4, device=device))


class _Reset(_Randn):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.pos_embedding, std=0.02)


class _Buffer(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(4.0, device=device))


def test_meta_dense_layers_are_initialised_or_refused():
    def build(extra: nn.Module) -> nn.Module:
        m = nn.Module()
        m.linear = nn.Linear(4, 3, device="meta")
        m.norm = nn.BatchNorm1d(3, device="meta")
        m.attn = nn.MultiheadAttention(4, 2, device="meta")
        m.extra = extra
        return m

    ok = build(_Reset("meta"))
    ok.tied = ok.linear  # tied modules stay tied
    materialize_dense(ok, torch.device("cpu"), skip=[])
    for name, t in [*ok.named_parameters(), *ok.named_buffers()]:
        assert not t.is_meta and not torch.isnan(t.float()).any(), name
    assert ok.tied.weight is ok.linear.weight and float(ok.norm.running_var.sum()) == 3.0
    assert float(ok.linear.weight.abs().sum()) > 0 and float(ok.extra.pos_embedding.std()) < 0.1
    assert ok.attn.in_proj_weight.abs().sum() > 0

    for extra, name in ((_Randn("meta"), "'extra.pos_embedding'"), (_Buffer("meta"), "'extra.table'")):
        m = build(extra)
        with pytest.raises(
            ValueError,
            match=rf"{name} was created on the meta device.*{type(extra).__name__} has no "
            r"`reset_parameters\(\)`.*HINT",
        ):
            materialize_dense(m, torch.device("cpu"), skip=[])

    kept = _Randn("cpu")  # not on meta: its values are the user's and stay
    before = kept.pos_embedding.detach().clone()
    materialize_dense(kept, torch.device("cpu"), skip=[])
    assert torch.equal(kept.pos_embedding, before) and not math.isnan(float(before.sum()))


@pytest.mark.dist
def test_lightnings_transfer_hooks_run_and_the_batch_they_build_is_checked(tmp_path):
    """``on_before_batch_transfer`` builds the KJT batch from raw rows on the host: recshard checks what it built
    (before the copy), calls the user's ``transfer_batch_to_device`` and ``on_after_batch_transfer``, and trains as
    plain PyTorch does; a bad id the hook produced is refused, naming its step."""
    good = run_ranks(user_scenarios.transfer_hooks, 1, tmp_path)[0]
    assert good["error"] is None and good["transfers"] == good["after"] == 5
    assert good["losses"] == pytest.approx(good["ref_losses"], abs=1e-5)
    bad = run_ranks(user_scenarios.transfer_hooks, 1, tmp_path, bad_step=2)[0]
    assert bad["error"].startswith(
        "InputError: training step 2 (epoch 0, batch 2): module 'ebc': feature 'user' (table 't_user', 60 rows) has 1 "
        "id(s) outside [0, 60): 65 (sample 0)."
    ), bad["error"]
    assert bad["transfers"] == 2  # refused before its copy
