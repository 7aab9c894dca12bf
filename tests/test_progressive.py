"""Progressive evaluation (issue 47, "Train on time"): every training batch scored before the step that trains on it,
AUROC / NE / log loss per period, over all ranks.

- A user-written model (dict batches, ``kt.values()``, torch's Adagrad) on 1 and 2 ranks: each period's numbers equal
  a plain-PyTorch replay's (the same model trained unsharded on whole batches, each batch scored in eval mode before
  its step), computed here from its scores without torchmetrics.
- The zoo DLRM on a time-ordered stream (``period: day``), 1 and 2 ranks: each day's numbers are those of every
  rank's scores of that day's rows before each step (recorded by the test, computed here; the days are pandas'); a fit
  resumed from a mid-period checkpoint reports every period as the uninterrupted fit does (the period's scores
  gathered into the checkpoint).

Each rank count is one launch, shared by the tests through module-scoped fixtures.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.user_models import ValuesModel, global_batches, rank_share, to_batch

LR = 0.05
STEPS, BATCH, EVERY = 7, 16, 3  # periods of 3 batches: 3, 3 and a last one of 1 (the epoch's end)
KEYS = ("auroc", "ne", "log_loss")


# ---- scenarios (one per launch) -----------------------------------------------------------------------------------
def user_model(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    """:class:`ValuesModel` on this rank's share of every global batch, scored every ``EVERY`` batches."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_rec import ProgressiveEvaluation, RecShardStrategy

    L.seed_everything(0)
    model = ValuesModel(seed=7, lr=LR)
    progressive = ProgressiveEvaluation(every_n_batches=EVERY)
    trainer = L.Trainer(
        strategy=RecShardStrategy(),
        accelerator="cpu",
        devices=world_size,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[progressive],
    )
    batches = [to_batch(rank_share(b, rank, world_size)) for b in global_batches(STEPS, BATCH)]
    trainer.fit(model, DataLoader(batches, batch_size=None))
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("progressive/")}
    return {"history": progressive.history, "logged": logged}


class _Scores:
    """The test's own record of the model's scores before each step: ``sigmoid(forward(batch))`` in eval mode without
    gradients, at each batch's start, with its labels and the epoch's batch number."""

    def __init__(self) -> None:
        import lightning as L

        seen = self.seen = []

        class Record(L.Callback):
            def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
                module.eval()
                with torch.no_grad():
                    scores = torch.sigmoid(module(batch))
                module.train()
                seen.append((batch_idx, scores.tolist(), batch.labels.tolist()))

        self.callback = Record()


def time_ordered(rank: int, world_size: int, out_dir: Path, parquet: str) -> dict[str, Any]:
    """The zoo DLRM on ``parquet`` replayed by day, a checkpoint saved inside a period; then resumed from it."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_rec import ProgressiveEvaluation, RecShardStrategy
    from lightning_rec.data import TabularDataModule
    from lightning_rec.models import DLRMModule

    schema = {
        "labels": [{"column": "click"}],
        "dense": [{"column": "x"}],
        "sparse": [{"column": "user", "ids": "hash", "num_embeddings": 50}, {"column": "item", "ids": "vocab"}],
    }

    def fit(save_at: int | None = None, ckpt: str | None = None) -> tuple[Any, list[Any], list[Any]]:
        dm = TabularDataModule(schema=schema, train=parquet, stream=True, period="day", time_column="ts", batch_size=8)
        L.seed_everything(3)
        model = DLRMModule(
            sparse_features=dm.sparse_features,
            num_dense_features=1,
            embedding_dim=8,
            dense_arch_layer_sizes=[8],
            over_arch_layer_sizes=[8, 1],
            dense_lr=0.01,
        )
        progressive, scores = ProgressiveEvaluation(), _Scores()
        callbacks: list[Any] = [scores.callback, progressive]
        if save_at:
            callbacks.append(
                ModelCheckpoint(dirpath=out_dir / "ckpt", every_n_train_steps=save_at, save_top_k=-1, filename="{step}")
            )
        trainer = L.Trainer(
            strategy=RecShardStrategy(),
            accelerator="cpu",
            devices=world_size,
            max_epochs=1,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=bool(save_at),
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )
        trainer.fit(model, dm, ckpt_path=ckpt)
        return dm, progressive.history, scores.seen

    probe = TabularDataModule(schema=schema, train=parquet, stream=True, period="day", time_column="ts", batch_size=8)
    probe.trainer = types.SimpleNamespace(global_rank=rank, world_size=world_size)  # its periods for this many ranks
    inside = next(p for p in probe.periods if p.batches >= 3)
    save_at = inside.first_batch + 2  # 2 of its batches scored and trained
    dm, trained, seen = fit(save_at=save_at)
    _, resumed, _ = fit(ckpt=str(next((out_dir / "ckpt").glob(f"step={save_at}*"))))
    periods = [p.as_dict() for p in dm.periods]
    return {"periods": periods, "trained": trained, "resumed": resumed, "save_at": save_at, "seen": seen}


# ---- the plain-PyTorch reference ------------------------------------------------------------------------------------
def _auroc(p: torch.Tensor, y: torch.Tensor) -> float:
    """The probability that a positive scores above a negative, ties counting half (Mann-Whitney)."""
    pos, neg = p[y == 1], p[y == 0]
    wins = (pos[:, None] > neg[None, :]).double().sum() + 0.5 * (pos[:, None] == neg[None, :]).double().sum()
    return float(wins / (len(pos) * len(neg)))


def _log_loss(p: torch.Tensor, y: torch.Tensor) -> float:
    p = p.double().clamp(1e-12, 1 - 1e-12)
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def _ne(p: torch.Tensor, y: torch.Tensor) -> float:
    base = y.double().mean()
    return _log_loss(p, y) / float(-(base * base.log() + (1 - base) * (1 - base).log()))


def _replay() -> list[dict[str, float]]:
    """ValuesModel trained unsharded on whole batches; each batch scored (eval mode, no gradients) before its step."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = ValuesModel(seed=7, lr=LR)
    opt = torch.optim.Adagrad(model.parameters(), lr=LR)
    scores, labels = [], []
    for rows in global_batches(STEPS, BATCH):
        batch = to_batch(rows)
        model.eval()
        with torch.no_grad():
            scores.append(torch.sigmoid(model(batch)))
        labels.append(batch["label"])
        model.train()
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(model(batch), batch["label"]).backward()
        opt.step()
    out = []
    for first in range(0, STEPS, EVERY):
        p, y = torch.cat(scores[first : first + EVERY]), torch.cat(labels[first : first + EVERY])
        out.append({"rows": len(y), "auroc": _auroc(p, y), "ne": _ne(p, y), "log_loss": _log_loss(p, y)})
    return out


@pytest.fixture(scope="module")
def user_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    return {w: run_ranks(user_model, w, tmp_path_factory.mktemp(f"user{w}")) for w in (1, 2)}


@pytest.mark.dist  # whole fits (in this process for 1 rank, two gloo ranks for 2)
@pytest.mark.parametrize("world", [1, 2])
def test_each_period_s_numbers_are_the_scores_before_each_step(world: int, user_runs: dict[int, Any]) -> None:
    reference = _replay()
    for rank, result in enumerate(user_runs[world]):
        history = result["history"]
        assert [(h["period"], h["rows"]) for h in history] == [(i, r["rows"]) for i, r in enumerate(reference)]
        for h, r in zip(history, reference):
            for key in KEYS:
                assert h[key] == pytest.approx(r[key], abs=2e-5), (rank, h["period"], key)
        assert result["logged"] == pytest.approx(
            {**{f"progressive/{k}": history[-1][k] for k in KEYS}, "progressive/period": 2.0}, abs=1e-6
        ), "the last period, as logged"
    scored_after = [r["auroc"] for r in reference]
    assert len({round(a, 3) for a in scored_after}) == len(scored_after), "periods that tell their scores apart"


# ---- the zoo DLRM on a time-ordered stream ------------------------------------------------------------------------
def _events(n: int = 307) -> pd.DataFrame:
    """Five days of clicks (unequal days) whose label follows the user, so a trained model gets better."""
    rng = np.random.default_rng(5)
    day = rng.choice(5, n, p=[0.15, 0.3, 0.2, 0.2, 0.15])
    user = rng.integers(0, 40, n)
    return pd.DataFrame(
        {
            "ts": 1_780_000_000 + day * 86_400 + rng.integers(0, 86_400, n),
            "x": rng.random(n),
            "user": user,
            "item": [f"i{v}" for v in rng.integers(0, 25, n)],
            "click": ((user % 3 == 0) ^ (rng.random(n) < 0.15)).astype(float),
        }
    )


@pytest.fixture(scope="module")
def stream_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    data = tmp_path_factory.mktemp("events")
    pq.write_table(pa.Table.from_pandas(_events(), preserve_index=False), data / "events.parquet", row_group_size=40)
    parquet = str(data / "events.parquet")
    return {w: run_ranks(time_ordered, w, tmp_path_factory.mktemp(f"stream{w}"), parquet=parquet) for w in (1, 2)}


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]], tol: float) -> None:
    assert [{k: v for k, v in h.items() if k not in KEYS} for h in a] == [
        {k: v for k, v in h.items() if k not in KEYS} for h in b
    ]
    for x, y in zip(a, b):
        for key in KEYS:
            assert x[key] == pytest.approx(y[key], abs=tol), (x["period"], key)


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2])
def test_each_day_s_numbers_are_every_rank_s_scores_of_that_day(world: int, stream_runs: dict[int, Any]) -> None:
    """The zoo DLRM on a time-ordered stream: each day's AUROC, NE and log loss are those of the scores the model gave
    that day's rows before each step, on every rank (recorded by the test), computed here; the days are pandas'."""
    runs = stream_runs[world]
    periods = runs[0]["periods"]
    scores: dict[int, list[float]] = {}
    labels: dict[int, list[float]] = {}
    for run in runs:
        for batch_idx, s, y in run["seen"][: sum(p["batches"] for p in periods)]:  # the first fit's batches
            day = next(p["index"] for p in periods if p["first_batch"] <= batch_idx < p["first_batch"] + p["batches"])
            scores.setdefault(day, []).extend(s)
            labels.setdefault(day, []).extend(y)
    days = pd.to_datetime(_events().ts, unit="s", utc=True).dt.floor("D").value_counts().sort_index()
    for run in runs:
        history = run["trained"]
        assert [(h["start"], h["rows"]) for h in history] == [(d.isoformat(), n) for d, n in days.items()]
        for h in history:
            p, y = torch.tensor(scores[h["period"]]), torch.tensor(labels[h["period"]])
            assert h["rows"] == len(y)
            reference = {"auroc": _auroc(p, y), "ne": _ne(p, y), "log_loss": _log_loss(p, y)}
            for key in KEYS:
                assert h[key] == pytest.approx(reference[key], abs=1e-6), (world, h["period"], key)
    assert runs[-1]["trained"] == runs[0]["trained"], "every rank holds the same history"


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2])
def test_a_fit_resumed_inside_a_period_reports_it_as_the_uninterrupted_fit(
    world: int, stream_runs: dict[int, Any]
) -> None:
    for result in stream_runs[world]:
        inside = next(
            p for p in result["periods"] if p["first_batch"] < result["save_at"] < p["first_batch"] + p["batches"]
        )
        assert inside, "the checkpoint was saved inside a period"
        _same(result["resumed"], result["trained"], 1e-9)


def test_data_without_periods_is_refused_before_training() -> None:
    import lightning as L

    from lightning_rec import ProgressiveEvaluation
    from lightning_rec.data import TabularDataModule

    dm = TabularDataModule(schema={"labels": [{"column": "click"}]}, train=["x.parquet"])
    trainer = types.SimpleNamespace(strategy=object(), datamodule=dm)
    with pytest.raises(ValueError, match=r"the training data \(TabularDataModule\) declares no periods\. HINT"):
        ProgressiveEvaluation().setup(trainer, L.LightningModule(), "fit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"every_n_batches is 0; a number >= 1"):
        ProgressiveEvaluation(every_n_batches=0)
