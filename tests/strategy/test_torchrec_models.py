"""TorchRec's own test models and inputs under recshard, compared with their unsharded reference the way TorchRec's
``sharding_single_rank_test`` compares them: the unsharded model trained on each global batch against the sharded one
trained on every rank's slice of it (the ranks' mean loss is the global loss: equal slices).

The model is ``torchrec.distributed.test_utils.test_model.TestSparseNN`` (nobody here wrote it): an
``EmbeddingBagCollection``, a position-weighted ``FeatureProcessedEmbeddingBagCollection`` reading features of the same
KeyedJaggedTensor, and a weighted ``EmbeddingBagCollection`` on a second one; inputs from ``ModelInput.generate``;
tables built on CPU with rows of their own. Wrapped as a user wraps it: ``loss, _ = self.model(batch)``.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.test_utils.test_model import ModelInput, TestSparseNN
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim import RowWiseAdagrad

import lightning_rec
from lightning_rec import EmbeddingOptimizer, RecShardStrategy
from lightning_rec._compat import fused_tbes
from lightning_rec._strategy import cpu_lookup
from lightning_rec._strategy.cpu_lookup import CpuLookup
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.dist import run_ranks

NUM_FLOAT = 16
LR = 0.02
TOL = 1e-5
POSITION_WEIGHTED = {"table_0": 5, "table_2": 5}  # max lengths: these tables read position-weighted ids
# The sharding types TorchRec lists for CUDA only, and the column-splitting ones, in one plan (table-wise is every other
# test's): row-wise and column-wise position-weighted tables, a grid-sharded plain one, weighted ones row-wise per
# host and data-parallel.
MIXED_PLAN = {
    "table_0": {"sharding_types": ["row_wise"]},
    "table_1": {"sharding_types": ["grid_shard"], "min_partition": 8},
    "table_2": {"sharding_types": ["column_wise"], "min_partition": 8},
    "weighted_table_0": {"sharding_types": ["table_row_wise"]},
    "weighted_table_1": {"sharding_types": ["data_parallel"]},
}
# Row-wise Adagrad keeps one accumulator per row, the mean over the row's columns: a table split column-wise keeps
# one per shard (FBGEMM's, as in TorchRec) and drifts from unsharded training, so its mixed plan splits no columns.
ROWWISE_ADAGRAD_PLAN = {**MIXED_PLAN, **{t: {"sharding_types": ["table_wise"]} for t in ("table_1", "table_2")}}
ROW_WISE_PLAN = {t: {"sharding_types": ["row_wise"]} for t in MIXED_PLAN}
TABLE_WISE_PLAN = {t: {"sharding_types": ["table_wise"]} for t in MIXED_PLAN}


def _tables():
    tables = [
        EmbeddingBagConfig(
            name=f"table_{i}", embedding_dim=16, num_embeddings=40 + 10 * i, feature_names=[f"feature_{i}"]
        )
        for i in range(3)
    ]
    weighted = [
        EmbeddingBagConfig(
            name=f"weighted_table_{i}",
            embedding_dim=8,
            num_embeddings=30 + 5 * i,
            feature_names=[f"weighted_feature_{i}"],
        )
        for i in range(2)
    ]
    return tables, weighted


def _model(seed: int, vbe: bool = False) -> TestSparseNN:
    """TestSparseNN; with ``vbe`` without weighted or position-weighted tables (TorchRec's variable-batch generator
    makes no weights, and the unsharded reference's feature processors need one batch size)."""
    torch.manual_seed(seed)
    tables, weighted = _tables()
    return TestSparseNN(
        tables=tables,
        weighted_tables=[] if vbe else weighted,
        num_float_features=NUM_FLOAT,
        dense_device=torch.device("cpu"),
        sparse_device=torch.device("cpu"),
        max_feature_lengths=None if vbe else POSITION_WEIGHTED,
    )


def _inputs(steps: int, world_size: int, seed: int = 100, vbe: bool = False):
    tables, weighted = _tables()
    if vbe:  # variable batch per feature: KJTs with a stride per feature and rank
        return [
            ModelInput.generate_variable_batch_input(
                average_batch_size=4,
                world_size=world_size,
                num_float_features=NUM_FLOAT,
                tables=tables,
                random_seed=seed + s,
            )
            for s in range(steps)
        ]
    return [
        ModelInput.generate(
            batch_size=4,
            world_size=world_size,
            num_float_features=NUM_FLOAT,
            tables=tables,
            weighted_tables=weighted,
            random_seed=seed + s,
            max_feature_lengths=[5] * len(tables),
        )
        for s in range(steps)
    ]


class TorchRecModel(lightning_rec.RecLightningModule):
    """A TorchRec model in a LightningModule, as a user writes it: the model computes its own loss."""

    def __init__(self, model: torch.nn.Module, optimizer: str = "sgd") -> None:
        super().__init__()
        self.model, self.optimizer = model, optimizer
        self.losses: list[float] = []

        self.automatic_optimization = optimizer != "two_optimizers"

    def training_step(self, batch: ModelInput, batch_idx: int) -> torch.Tensor:
        loss, _ = self.model(batch)
        self.losses.append(float(loss.detach()))
        if not self.automatic_optimization:  # several optimizers: Lightning's manual optimization
            optimizers = self.optimizers()
            for opt in optimizers:
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in optimizers:
                opt.step()
        return loss

    def predict_step(self, batch: ModelInput, batch_idx: int) -> torch.Tensor:
        return self.model(batch)

    def configure_optimizers(self) -> Any:
        if self.optimizer in ("param_groups", "two_optimizers"):
            return _per_table_optimizers(self.optimizer, dict(self.named_parameters()))
        return _torch_optimizer(self.optimizer, self.parameters())

    def configure_embedding_optimizer(self) -> EmbeddingOptimizer | None:
        return EmbeddingOptimizer("rowwise_adagrad", lr=LR, eps=1e-8) if self.optimizer == "rowwise_adagrad" else None


def _per_table_optimizers(how: str, named: dict[str, torch.nn.Parameter]) -> Any:
    """Tables in param groups of their own: ``"param_groups"``, one Adagrad whose groups give the plain tables, the
    weighted ones and the dense layers three learning rates, with a scheduler halving them every step;
    ``"two_optimizers"``, Adagrad for the dense layers and plain tables, SGD for the weighted tables."""
    plain = [p for n, p in named.items() if ".embedding_bags.table_" in n]
    weighted = [p for n, p in named.items() if ".embedding_bags.weighted_table_" in n]
    dense = [p for n, p in named.items() if ".embedding_bags." not in n]
    if how == "param_groups":
        opt = torch.optim.Adagrad(
            [{"params": dense}, {"params": plain, "lr": 0.05}, {"params": weighted, "lr": 0.01}], lr=LR, eps=1e-8
        )
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
    return [
        torch.optim.Adagrad([{"params": dense}, {"params": plain, "lr": 0.05}], lr=LR, eps=1e-8),
        torch.optim.SGD(weighted, lr=0.5),
    ]


def _torch_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR) if name == "sgd" else torch.optim.Adagrad(params, lr=LR, eps=1e-8)


def _in_backward(model: TestSparseNN) -> None:
    """TorchRec's per-table optimizer: the weighted tables get row-wise Adagrad of their own, applied in backward."""
    from torchrec.optim import apply_optimizer_in_backward

    weights = [p for n, p in model.named_parameters() if ".embedding_bags.weighted_table_" in n]
    apply_optimizer_in_backward(RowWiseAdagrad, weights, {"lr": 0.05, "eps": 1e-8})


def _reference(model: TestSparseNN, inputs, optimizer: str, eval_input: ModelInput) -> dict[str, Any]:
    """Plain PyTorch on the unsharded model, whole global batches: the losses, then the predictions."""
    model = copy.deepcopy(model)
    if optimizer == "in_backward":  # those tables step in the backward pass; the optimizer gets the rest
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        _in_backward(model)
        rest = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
        model_optimizer = torch.optim.Adagrad(rest, lr=LR, eps=1e-8)
    named = dict(model.named_parameters())
    is_table = {n: ".embedding_bags." in n for n in named}
    if optimizer == "rowwise_adagrad":  # tables: row-wise Adagrad (FBGEMM's), the rest as configure_optimizers says
        opts = [
            RowWiseAdagrad([p for n, p in named.items() if is_table[n]], lr=LR, eps=1e-8),
            torch.optim.Adagrad([p for n, p in named.items() if not is_table[n]], lr=LR, eps=1e-8),
        ]
    elif optimizer == "in_backward":
        opts = [model_optimizer]
    elif optimizer in ("param_groups", "two_optimizers"):
        configured = _per_table_optimizers(optimizer, named)
        opts = [configured["optimizer"]] if isinstance(configured, dict) else configured
    else:
        opts = [_torch_optimizer(optimizer, model.parameters())]
    schedulers = [configured["lr_scheduler"]["scheduler"]] if optimizer == "param_groups" else []
    losses = []
    for global_input, _ in inputs:
        for opt in opts:
            opt.zero_grad()
        loss, _ = model(global_input)
        loss.backward()
        for opt in opts:
            opt.step()
        for scheduler in schedulers:
            scheduler.step()
        losses.append(float(loss))
    model.eval()
    with torch.no_grad():
        return {"ref_losses": losses, "ref_preds": model(eval_input).tolist()}


def _trainer(world_size: int, steps: int = 1, accelerator: str = "cpu", **strategy: Any) -> L.Trainer:
    return L.Trainer(
        strategy=RecShardStrategy(**strategy),
        accelerator=accelerator,
        devices=world_size,
        max_steps=steps,
        **QUIET_TRAINER,
    )


def _eval_input(rank: int, world_size: int, vbe: bool = False) -> ModelInput:
    """Held-out rows: the whole batch on 1 rank, its halves on 2 (concatenated, the halves are the whole)."""
    whole, halves = _inputs(1, 2, seed=7, vbe=vbe)[0]
    return whole if world_size == 1 else halves[rank]


def _predict(
    trainer: L.Trainer, module: TorchRecModel, rank: int, world_size: int, vbe: bool = False, **kwargs: Any
) -> list[float]:
    loader = DataLoader([_eval_input(rank, world_size, vbe)], batch_size=None)
    return torch.cat(trainer.predict(module, loader, **kwargs)).tolist()


def fit(
    rank: int,
    world_size: int,
    out_dir: Path,
    constraints: dict[str, Any] | None = None,
    optimizer: str = "sgd",
    steps: int = 3,
    save: str | None = None,
    sharders: list[Any] | None = None,
    vbe: bool = False,
    accelerator: str = "cpu",
    fast_cpu_lookup: bool = True,
    threads: int = 0,
    split_every_call: bool = False,
    on_trial: bool = False,
) -> dict[str, Any]:
    """Train on this rank's slice of every global batch; rank 0 also trains the unsharded reference. ``threads``: the
    intra-op threads of this rank (0: as launched). ``split_every_call``: the CPU lookup takes its split path on
    every call (this model is far below the work where the default takes it), to compare its bits. ``on_trial``:
    every call is big enough to be measured, so the lookups run the default's trial of both paths (timed: which one
    it keeps may differ from run to run)."""
    if threads:
        torch.set_num_threads(threads)
    model = _model(seed=0, vbe=vbe)
    inputs = _inputs(steps, world_size, vbe=vbe)
    result = _reference(model, inputs, optimizer, _eval_input(0, 1, vbe)) if rank == 0 else {}
    if optimizer == "in_backward":
        _in_backward(model)
    module = TorchRecModel(model, optimizer)
    # Lightning counts a global step per `optimizer.step()`: two a batch with two optimizers.
    max_steps = steps * (2 if optimizer == "two_optimizers" else 1)
    trainer = _trainer(
        world_size, max_steps, accelerator, constraints=constraints, sharders=sharders, fast_cpu_lookup=fast_cpu_lookup
    )
    with (
        warnings.catch_warnings(),
        mock.patch.object(
            cpu_lookup, "MIN_FAST_WORK", 0 if split_every_call else 1 if on_trial else cpu_lookup.MIN_FAST_WORK
        ),
    ):
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader([local[rank] for _, local in inputs], batch_size=None))
    if save:
        trainer.save_checkpoint(out_dir / save)
    plan = {t: s.sharding_type for m in trainer.strategy.sharding_plan.plan.values() for t, s in m.items()}
    preds = [float(x) for x in _predict(trainer, module, rank, world_size, vbe)]
    # Each fused kernel: its forward, the threads its backward splits the tables over (recshard's CPU lookup), and
    # whether its calls took the split.
    lookups = {
        where: ("CpuLookup", tbe.forward.threads, tbe.forward.taken["fast"] > 0)
        if isinstance(tbe.forward, CpuLookup)
        else ("fbgemm", 1, False)
        for where, tbe in fused_tbes(module)
    }
    trials = {id(tbe.forward.trial) for _, tbe in fused_tbes(module) if isinstance(tbe.forward, CpuLookup)}
    return {**result, "losses": module.losses, "preds": preds, "plan": plan, "lookups": lookups, "trials": len(trials)}


def predict_from(
    rank: int, world_size: int, out_dir: Path, ckpt: str, constraints: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A fresh model (other rows and weights: everything must come from the checkpoint) predicts under ``constraints``."""
    module = TorchRecModel(_model(seed=1234))
    trainer = _trainer(world_size, constraints=constraints)
    return {"preds": _predict(trainer, module, rank, world_size, ckpt_path=ckpt)}


def _mean_losses(results: list[dict[str, Any]]) -> list[float]:
    return [sum(r["losses"][i] for r in results) / len(results) for i in range(len(results[0]["losses"]))]


def _preds(results: list[dict[str, Any]]) -> list[float]:
    return [x for r in results for x in r["preds"]]


@pytest.mark.dist
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_every_cpu_sharding_type_trains_testsparsenn_like_unsharded_torchrec(tmp_path, optimizer):
    plan = ROWWISE_ADAGRAD_PLAN if optimizer == "rowwise_adagrad" else MIXED_PLAN
    results = run_ranks(fit, 2, tmp_path, constraints=plan, optimizer=optimizer)
    ref = results[0]
    assert results[0]["plan"] == {t: c["sharding_types"][0] for t, c in plan.items()}
    assert _mean_losses(results) == pytest.approx(ref["ref_losses"], abs=TOL)
    assert _preds(results) == pytest.approx(ref["ref_preds"], abs=TOL)


@pytest.mark.dist
def test_row_wise_checkpoints_reshard_to_every_other_type_and_world_size(tmp_path):
    two = run_ranks(fit, 2, tmp_path, constraints=ROW_WISE_PLAN, optimizer="rowwise_adagrad", save="rw2")
    assert _mean_losses(two) == pytest.approx(two[0]["ref_losses"], abs=TOL)
    expected = two[0]["ref_preds"]
    for ranks, plan in ((1, TABLE_WISE_PLAN), (2, MIXED_PLAN)):
        res = run_ranks(predict_from, ranks, tmp_path / f"to{ranks}", ckpt=str(tmp_path / "rw2"), constraints=plan)
        assert _preds(res) == pytest.approx(expected, abs=TOL), (ranks, plan)
    # Exported to one unsharded state dict, TorchRec's plain model predicts the same (in this process, no ranks).
    from lightning_rec.checkpoint import export, load_exported

    export(tmp_path / "rw2", tmp_path / "rw2.pt", prefix="model.")
    plain = _model(seed=4321)
    plain.load_state_dict(load_exported(tmp_path / "rw2.pt"))
    plain.eval()
    with torch.no_grad():
        assert plain(_eval_input(0, 1)).tolist() == pytest.approx(expected, abs=TOL)
    # ... and from every other type (2 ranks) into row-wise on 1 rank.
    mixed = run_ranks(fit, 2, tmp_path / "mixed", constraints=MIXED_PLAN, optimizer="adagrad", save="mx")
    res = run_ranks(predict_from, 1, tmp_path / "mx1", ckpt=str(tmp_path / "mixed" / "mx"), constraints=ROW_WISE_PLAN)
    assert _preds(res) == pytest.approx(mixed[0]["ref_preds"], abs=TOL)


@pytest.mark.parametrize("optimizer", ["adagrad"])  # (SGD: tests/strategy/test_cpu_lookup.py, to the bit)
def test_the_default_cpu_lookup_trains_like_unsharded_torchrec_and_gives_fbgemm_s_bits(tmp_path, optimizer):
    fast = fit(0, 1, tmp_path, constraints=TABLE_WISE_PLAN, optimizer=optimizer, threads=2, split_every_call=True)
    assert fast["lookups"] and all(v == ("CpuLookup", 2, True) for v in fast["lookups"].values()), fast["lookups"]
    assert fast["losses"] == pytest.approx(fast["ref_losses"], abs=TOL)
    assert fast["preds"] == pytest.approx(fast["ref_preds"], abs=TOL)
    own = fit(0, 1, tmp_path, constraints=TABLE_WISE_PLAN, optimizer=optimizer, fast_cpu_lookup=False)
    assert own["lookups"] and set(own["lookups"].values()) == {("fbgemm", 1, False)}
    assert (own["losses"], own["preds"]) == (fast["losses"], fast["preds"])  # to the bit
    default = fit(0, 1, tmp_path, constraints=TABLE_WISE_PLAN, optimizer=optimizer, threads=2)
    # installed, but this model's lookups are far too small for the split: FBGEMM's path, call by call
    assert default["lookups"] and set(default["lookups"].values()) == {("CpuLookup", 2, False)}
    assert (default["losses"], default["preds"]) == (fast["losses"], fast["preds"])


def test_a_measured_cpu_lookup_trains_testsparsenn_to_fbgemm_s_bits(tmp_path):
    """Every call of TorchRec's test model on trial, as a big model's are: its kernels share one trial, which runs a
    block of steps on FBGEMM's path and one on the split (stopping the split's threads in between), then keeps one;
    whatever it keeps, the training gives FBGEMM's own bits and the unsharded model's numbers."""
    steps = cpu_lookup.TRIAL_CALLS + 3
    own = fit(0, 1, tmp_path, constraints=TABLE_WISE_PLAN, optimizer="adagrad", steps=steps, fast_cpu_lookup=False)
    measured = fit(
        0, 1, tmp_path, constraints=TABLE_WISE_PLAN, optimizer="adagrad", steps=steps, threads=2, on_trial=True
    )
    assert len(measured["lookups"]) >= 2 and measured["trials"] == 1, measured["lookups"]
    assert all(v == ("CpuLookup", 2, True) for v in measured["lookups"].values()), measured[
        "lookups"
    ]  # split block ran
    assert (measured["losses"], measured["preds"]) == (own["losses"], own["preds"])  # to the bit
    assert measured["losses"] == pytest.approx(measured["ref_losses"], abs=TOL)


@pytest.mark.dist
def test_the_default_cpu_lookup_on_two_ranks_with_two_threads_each_trains_like_unsharded_torchrec(tmp_path):
    results = run_ranks(fit, 2, tmp_path, constraints=MIXED_PLAN, optimizer="adagrad", threads=2, split_every_call=True)
    for r in results:  # every fused kernel took the fast path, its backward split over two threads
        assert r["lookups"] and all(tuple(v) == ("CpuLookup", 2, True) for v in r["lookups"].values()), r["lookups"]
    assert _mean_losses(results) == pytest.approx(results[0]["ref_losses"], abs=TOL)
    assert _preds(results) == pytest.approx(results[0]["ref_preds"], abs=TOL)


def test_row_wise_on_one_rank_trains_like_unsharded_torchrec(tmp_path):
    (result,) = [fit(0, 1, tmp_path, constraints=ROW_WISE_PLAN, optimizer="rowwise_adagrad")]
    assert set(result["plan"].values()) == {"row_wise"}
    assert result["losses"] == pytest.approx(result["ref_losses"], abs=TOL)
    assert result["preds"] == pytest.approx(result["ref_preds"], abs=TOL)


class _RowWiseOnCpu(EmbeddingBagCollectionSharder):
    """A sharder as a TorchRec user subclasses one (here: to admit row-wise on CPU); it sets no optimizer."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return super().sharding_types("cuda")


def test_a_sharder_the_user_passes_keeps_the_optimizer_of_configure_optimizers(tmp_path):
    sharders = [_RowWiseOnCpu(), EmbeddingCollectionSharder()]
    result = fit(0, 1, tmp_path, constraints=ROW_WISE_PLAN, optimizer="adagrad", steps=6, sharders=sharders)
    assert set(result["plan"].values()) == {"row_wise"}
    assert result["losses"] == pytest.approx(result["ref_losses"], abs=TOL)
    assert result["preds"] == pytest.approx(result["ref_preds"], abs=TOL)
    assert sharders[0].fused_params is None  # the user's sharder itself is left as it was


def test_a_sharder_with_another_optimizer_is_refused_naming_both():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from lightning_rec._planner.sharders import make_sharders

    derived = EmbeddingOptimizer("adagrad", lr=0.5).to_fused_params()
    own = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "eps": 1e-8})
    with pytest.raises(
        ValueError,
        match=r"EmbeddingBagCollectionSharder sets the embedding optimizer optimizer=.*"
        r"EXACT_ROWWISE_ADAGRAD.*has optimizer=.*EXACT_ADAGRAD",
    ):
        make_sharders(derived, [own])
    agreeing = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.5}
    )
    (ebc,) = [s for s in make_sharders(derived, [agreeing]) if s.module_type is EmbeddingBagCollection]
    assert ebc.fused_params["optimizer"] == EmbOptimType.EXACT_ADAGRAD and ebc.fused_params["eps"] == derived["eps"]


@pytest.mark.dist
def test_quantized_comms_halve_what_the_tables_send_and_stay_near_full_precision():
    from benchmarks.qcomms import measure

    result = measure(["fp32", "bf16"], plan="row_wise", steps=4, batch=8)
    bf16 = result["bf16"]
    assert bf16["bytes_vs_baseline"] == 0.5  # every embedding all-to-all / reduce-scatter carried 2-byte values
    assert bf16["input_bytes_per_step"] == result["fp32"]["input_bytes_per_step"]  # ids are never quantized
    assert 0 < bf16["max_loss_diff"] < 1e-4 and bf16["max_pred_diff"] < 1e-3  # BENCHMARKS.md "Quantized comms"


def test_quantized_comms_that_cannot_run_on_cpu_are_refused_naming_why():
    from torchrec import EmbeddingConfig

    from lightning_rec._planner.devices import check_qcomms
    from lightning_rec.config import QuantizedComms, TableConstraints

    tables = {c.name: c for c in _tables()[0]}
    with pytest.raises(ValueError, match="fp8 cannot run on CPU"):
        check_qcomms(QuantizedComms("fp16", backward="fp8"), tables, {}, "cpu")
    rows = {"table_1": TableConstraints(sharding_types=["row_wise"])}
    with pytest.raises(ValueError, match=r"int8 cannot run on CPU for tables \['table_1'\] constrained to row_wise"):
        check_qcomms(QuantizedComms("int8"), tables, rows, "cpu")
    seq = {"t_seq": EmbeddingConfig(name="t_seq", embedding_dim=8, num_embeddings=10, feature_names=["s"])}
    with pytest.raises(ValueError, match=r"EmbeddingCollection tables \['t_seq'\]"):
        check_qcomms(QuantizedComms("int8"), {**tables, **seq}, {}, "cpu")
    for ok in ("fp16", "bf16", "int8"):
        check_qcomms(QuantizedComms(ok), tables, {}, "cpu")
    check_qcomms(QuantizedComms("fp8"), {**tables, **seq}, rows, "cuda")
    # Wired into the strategy: refused when the model is connected, before anything is sharded.
    strategy = RecShardStrategy(qcomms={"forward": "fp8"})
    with pytest.raises(ValueError, match="fp8 cannot run on CPU"):
        strategy.sharding.check_model(TorchRecModel(_model(0)), "cpu")


@pytest.mark.dist
@pytest.mark.parametrize("types", [("table_wise", "table_wise"), ("row_wise", "table_row_wise")])
def test_variable_batch_per_feature_trains_like_unsharded_torchrec_where_torchrec_runs_it(tmp_path, types):
    """Row-wise and table-row-wise tables over gloo too: their gradients' unequal all-gather is padded
    (lightning_rec._strategy.uneven_batches)."""
    plan = {"table_0": {"sharding_types": [types[0]]}, "table_1": {"sharding_types": [types[1]]}}
    plan["table_2"] = {"sharding_types": ["column_wise"], "min_partition": 8}
    results = run_ranks(fit, 2, tmp_path, constraints=plan, optimizer="sgd", vbe=True)
    assert results[0]["plan"] == {t: c["sharding_types"][0] for t, c in plan.items()}
    assert _mean_losses(results) == pytest.approx(results[0]["ref_losses"], abs=TOL)
    assert _preds(results) == pytest.approx(results[0]["ref_preds"], abs=TOL)


@pytest.mark.parametrize(
    ("optimizer", "plan", "reason"),
    [
        (
            "adagrad",
            {"table_0": {"sharding_types": ["table_wise"]}},
            r"train variable-batch inputs with sgd, rowwise_adagrad, adam only.*adagrad",
        ),
        (
            "sgd",
            {"table_0": {"sharding_types": ["data_parallel"]}},
            r"on CPU TorchRec fails on them .*table_0 \(data_parallel\)",
        ),
    ],
)
def test_variable_batch_inputs_torchrec_cannot_train_are_refused_naming_why(tmp_path, optimizer, plan, reason):
    from lightning_rec.errors import InputError

    with pytest.raises(InputError, match=rf"module 'model.sparse.ebc': .*variable batch size per feature.*{reason}"):
        fit(0, 1, tmp_path, constraints=plan, optimizer=optimizer, vbe=True, steps=1)


def test_variable_batch_inputs_train_row_wise_on_one_rank(tmp_path):
    result = fit(0, 1, tmp_path, constraints={"table_0": {"sharding_types": ["row_wise"]}}, vbe=True)
    assert result["losses"] == pytest.approx(result["ref_losses"], abs=TOL)
    assert result["preds"] == pytest.approx(result["ref_preds"], abs=TOL)


@pytest.mark.dist
def test_tables_in_param_groups_of_their_own_train_each_by_its_group_as_plain_pytorch(tmp_path):
    """Three learning rates in one Adagrad (plain tables, weighted tables, dense), all halved every step by a
    scheduler: every table follows its own group (TorchRec groups tables by their fused parameters)."""
    results = run_ranks(fit, 2, tmp_path, constraints=MIXED_PLAN, optimizer="param_groups", steps=4)
    assert _mean_losses(results) == pytest.approx(results[0]["ref_losses"], abs=TOL)
    assert _preds(results) == pytest.approx(results[0]["ref_preds"], abs=TOL)


def test_tables_under_two_optimizers_train_each_by_its_own(tmp_path):
    """Adagrad for the plain tables and the dense layers, SGD for the weighted tables (manual optimization)."""
    result = fit(0, 1, tmp_path, constraints=ROWWISE_ADAGRAD_PLAN, optimizer="two_optimizers", steps=4)
    assert result["losses"] == pytest.approx(result["ref_losses"], abs=TOL)
    assert result["preds"] == pytest.approx(result["ref_preds"], abs=TOL)


# GPU twin: the same TorchRec model and plans on CUDA (nccl), where a GPU is present; it skips elsewhere.
@pytest.mark.dist
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and the CUDA build of FBGEMM")
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_on_cuda_every_sharding_type_trains_testsparsenn_like_unsharded_torchrec(tmp_path, world_size, optimizer):
    if world_size > torch.cuda.device_count():
        pytest.skip(f"needs {world_size} GPUs")
    plan = ROWWISE_ADAGRAD_PLAN if optimizer == "rowwise_adagrad" else MIXED_PLAN
    results = run_ranks(fit, world_size, tmp_path, constraints=plan, optimizer=optimizer, accelerator="gpu")
    # Other kernels than the CPU reference's: to 1e-4.
    assert _mean_losses(results) == pytest.approx(results[0]["ref_losses"], abs=1e-4)
    assert _preds(results) == pytest.approx(results[0]["ref_preds"], abs=1e-4)


def test_tables_given_their_own_optimizer_with_apply_optimizer_in_backward_keep_it(tmp_path):
    """TorchRec's per-table API: row-wise Adagrad for the weighted tables, Adagrad from configure_optimizers for the
    rest (TorchRec leaves in-backward parameters out of the other optimizers)."""
    result = fit(0, 1, tmp_path, constraints=ROWWISE_ADAGRAD_PLAN, optimizer="in_backward", steps=4)
    assert result["losses"] == pytest.approx(result["ref_losses"], abs=TOL)
    assert result["preds"] == pytest.approx(result["ref_preds"], abs=TOL)
