"""Unit tests: embedding optimizer derivation, parameter stripping, and RecOptimizer's step contract; and what
Lightning's ``LearningRateMonitor`` reports of it (one rank, a real fit)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.keyed import KeyedOptimizer

from lightning_rec import RecShardStrategy
from lightning_rec._strategy.optim import (
    RecOptimizer,
    embedding_optimizer_from_torch,
    find_embedding_group,
    strip_params,
)
from lightning_rec.checkpoint._optimizer_state import ComposedOptimizer
from lightning_rec.config import EmbeddingOptimizer, supported_optimizers
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.dist import run_ranks
from tests.helpers.user_models import ValuesModel, global_batches, to_batch


def _derive(opt):
    return embedding_optimizer_from_torch(opt, opt.param_groups[0])


def _p(*shape):
    return torch.nn.Parameter(torch.zeros(*shape))


def test_derives_the_same_family_and_hyperparameters():
    assert _derive(torch.optim.SGD([_p(2)], lr=0.3)) == EmbeddingOptimizer("sgd", lr=0.3)
    assert _derive(torch.optim.Adagrad([_p(2)], lr=0.2, eps=1e-6)) == EmbeddingOptimizer("adagrad", lr=0.2, eps=1e-6)
    assert _derive(RowWiseAdagrad([_p(2, 2)], lr=0.05)).name == "rowwise_adagrad"
    adam = _derive(torch.optim.Adam([_p(2)], lr=1e-3, betas=(0.8, 0.9)))
    assert (adam.name, adam.lr, adam.betas) == ("adam", 1e-3, (0.8, 0.9))


@pytest.mark.parametrize(
    "opt, needle",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "momentum=0.9"),
        (lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01), "lr_decay=0.01"),
        (lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.1), "weight_decay=0.1"),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), "AdamW"),
        (lambda ps: torch.optim.RMSprop(ps, lr=0.1), "no fused"),
    ],
)
def test_refuses_what_fbgemm_would_train_differently(opt, needle):
    with pytest.raises(ValueError, match="HINT") as info:
        _derive(opt([_p(2)]))
    assert needle in str(info.value)


def test_device_support():
    assert supported_optimizers("cpu") == ("sgd", "adagrad", "rowwise_adagrad")
    assert "adam" in supported_optimizers("cuda")
    EmbeddingOptimizer("adam").validate_for("cuda")
    with pytest.raises(ValueError, match="no FBGEMM kernel on CPU. Supported there: sgd, adagrad, rowwise_adagrad"):
        EmbeddingOptimizer("adam").validate_for("cpu")
    with pytest.raises(ValueError, match="unknown optimizer 'adamw'"):
        EmbeddingOptimizer("adamw")  # type: ignore[arg-type]


def test_fused_params_carry_the_hyperparameters():
    fp = EmbeddingOptimizer("adagrad", lr=0.2, eps=1e-9, weight_decay=0.01).to_fused_params()
    assert fp["learning_rate"] == 0.2 and fp["eps"] == 1e-9 and fp["weight_decay"] == 0.01
    assert fp["optimizer"].name == "EXACT_ADAGRAD"


def test_strip_params_keeps_groups_and_remaining_state():
    emb, dense = _p(4, 2), _p(3)
    opt = torch.optim.Adagrad([{"params": [dense]}, {"params": [emb], "lr": 0.5}], lr=0.1)
    assert find_embedding_group([opt], lambda p: p is emb)[1]["lr"] == 0.5
    assert strip_params(opt, lambda p: p is emb) == 1
    assert [len(g["params"]) for g in opt.param_groups] == [1, 0]  # the empty group still carries its lr
    assert emb not in opt.state and dense in opt.state


def test_embedding_params_in_several_groups_is_an_error():
    a, b = _p(2), _p(2)
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
    with pytest.raises(ValueError, match="spread over 2 optimizer param groups"):
        find_embedding_group([opt], lambda p: p is a or p is b)


class _FakeFused(KeyedOptimizer):
    """Stands in for a TorchRec fused optimizer: step() only pushes the lr into the 'kernel'."""

    def __init__(self) -> None:
        super().__init__({}, {}, [{"lr": 1.0, "params": []}])
        self.kernel_lr = None

    def step(self, closure=None):
        self.kernel_lr = self.param_groups[0]["lr"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def test_step_runs_the_closure_exactly_once_and_tables_follow_the_lr():
    w = _p(1)
    dense = torch.optim.SGD([w], lr=0.1)
    fused = _FakeFused()
    opt = RecOptimizer(fused, dense, {"w": w}, lr_source=dense.param_groups[0])
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = (w - 1.0).pow(2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert len(calls) == 1 and float(loss) == 1.0
    assert float(w) == pytest.approx(0.2)  # 0 - 0.1 * d/dw (w-1)^2 = 0.2
    dense.param_groups[0]["lr"] = 0.01  # what an LR scheduler does
    opt.step(closure)
    assert len(calls) == 2 and fused.kernel_lr == 0.01 and opt.embedding_lrs == [0.01]
    assert set(opt.params) == {"w"}  # keyed by parameter name, as in the model's state_dict
    # Checkpoints read it through the interface they define; LearningRateMonitor reports the user's optimizer.
    assert isinstance(opt, ComposedOptimizer) and opt.optimizer is dense


# ---------------------------------------------------------------------------------------------------------------
# LearningRateMonitor: the user's optimizer and param groups, as without sharding.
# ---------------------------------------------------------------------------------------------------------------

LR_CASES = ("single", "scheduler", "groups")


class _LrModel(ValuesModel):
    """One ``Adagrad`` as users write it: over every parameter, under a per-step ``StepLR`` (``"scheduler"``), or
    in two param groups, the tables' named (``"groups"``)."""

    def __init__(self, case: str) -> None:
        super().__init__(lr=0.05)
        self.case = case

    def configure_optimizers(self) -> Any:
        if self.case == "groups":
            dense = [p for n, p in self.named_parameters() if not n.startswith("ebc.")]
            opt = torch.optim.Adagrad(
                [{"params": list(self.ebc.parameters()), "lr": 0.05, "name": "tables"}, {"params": dense, "lr": 0.02}]
            )
        else:
            opt = torch.optim.Adagrad(self.parameters(), lr=0.05)
        if self.case != "scheduler":
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def lr_monitor_logs(rank: int, world_size: int, out_dir: Path, steps: int = 5) -> dict[str, Any]:
    """Per case and strategy (plain Lightning, recshard): the rows a ``CSVLogger`` got from ``LearningRateMonitor``,
    each ``{"step": ..., "lr-...": ...}``."""
    quiet = {k: v for k, v in QUIET_TRAINER.items() if k != "logger"}
    logged: dict[str, Any] = {}
    for case in LR_CASES:
        for name in ("plain", "recshard"):
            logger = CSVLogger(out_dir / "lr", name=case, version=name)
            trainer = L.Trainer(
                strategy=RecShardStrategy() if name == "recshard" else "auto",
                accelerator="cpu",
                devices=1,
                max_steps=steps,
                logger=logger,
                callbacks=[LearningRateMonitor()],
                log_every_n_steps=1,
                **quiet,
            )
            batches = [to_batch(b) for b in global_batches(steps, 8)]
            trainer.fit(_LrModel(case), DataLoader(batches, batch_size=None))
            with open(Path(logger.log_dir) / "metrics.csv") as f:
                rows = list(csv.DictReader(f))
            logged[f"{case}/{name}"] = [
                {"step": int(row["step"]), **lrs}
                for row in rows
                if (lrs := {k: float(v) for k, v in row.items() if v and k.startswith("lr-")})
            ]
    return logged


@pytest.mark.dist
def test_learning_rate_monitor_logs_the_users_optimizer_names_and_groups(tmp_path):
    """Dashboards see the optimizer and param groups the user wrote (``lr-Adagrad``, ``lr-Adagrad/tables``), with
    the same values at the same steps as plain Lightning, from step 0 to the end; not the strategy's RecOptimizer."""
    steps = 5
    logged = run_ranks(lr_monitor_logs, 1, tmp_path, steps=steps)[0]
    names = {"single": {"lr-Adagrad"}, "scheduler": {"lr-Adagrad"}, "groups": {"lr-Adagrad/tables", "lr-Adagrad/pg2"}}
    for case in LR_CASES:
        plain, ours = logged[f"{case}/plain"], logged[f"{case}/recshard"]
        assert {r["step"] for r in plain} == set(range(steps)), plain
        assert all(set(r) == {"step"} | names[case] for r in plain), plain
        assert ours == plain, case
    assert [r["lr-Adagrad"] for r in logged["scheduler/plain"]] == [0.05, 0.05, 0.025, 0.025, 0.0125]
