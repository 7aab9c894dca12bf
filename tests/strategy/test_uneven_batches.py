"""Batches of different sizes on each rank, with every sharding type, on 2 and 3 gloo ranks: the numbers of one
process training the unsharded model on the same rows.

A data set's row count is rarely a multiple of the ranks: the last batch of an epoch then has a row more on some ranks
(by one), a user's own loader may give ranks very different batches (by many), and a rank whose share ran out first
gets an empty one. The model is TorchRec's ``TestSparseNN`` (plain, position-weighted and weighted tables, its own
loss), its inputs TorchRec's ``ModelInput.generate``, one per rank at that rank's batch size.

The reference is one process, the unsharded model, plain PyTorch: each step's loss is the mean of the ranks' own
(each the model's mean over that rank's rows), which is what DDP and TorchRec optimise (every rank's gradient weighs
the same; an empty batch adds nothing and still counts as a rank).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torchrec.distributed.test_utils.test_model import ModelInput

from tests.helpers.dist import run_ranks
from tests.helpers.side_by_side import selected, side_by_side
from tests.strategy.test_torchrec_models import (
    LR,
    MIXED_PLAN,
    NUM_FLOAT,
    TOL,
    TorchRecModel,
    _eval_input,
    _model,
    _tables,
    _trainer,
)

# Per step, each rank's batch size: by one (an odd row count's last batch), by many, a rank with an empty batch.
SIZES = {
    2: [(5, 4), (1, 6), (3, 0), (4, 4)],
    3: [(5, 4, 4), (7, 1, 3), (2, 0, 1), (3, 3, 3)],
}
# Every sharding type the planner may pick on CPU, in two plans: MIXED_PLAN has row-wise, grid, column-wise,
# table-row-wise and data-parallel tables; this one is table-wise throughout.
TABLE_WISE = {t: {"sharding_types": ["table_wise"]} for t in MIXED_PLAN}
PLANS = {"mixed": MIXED_PLAN, "table_wise": TABLE_WISE}


def _rank_inputs(world_size: int) -> list[list[ModelInput | None]]:
    """Per step, each rank's batch (``None``: an empty one, built from a non-empty one by slicing)."""
    tables, weighted = _tables()
    steps = []
    for step, sizes in enumerate(SIZES[world_size]):
        batches = []
        for rank, size in enumerate(sizes):
            batch, _ = ModelInput.generate(
                batch_size=max(size, 1),
                world_size=1,
                num_float_features=NUM_FLOAT,
                tables=tables,
                weighted_tables=weighted,
                random_seed=1000 * step + rank,
                max_feature_lengths=[5] * len(tables),
            )
            batches.append(batch if size else None)
        steps.append(batches)
    return steps


def _empty_like(batch: ModelInput) -> ModelInput:
    """``batch`` with no samples: every KJT with its keys and no lengths, tensors with no rows."""

    def empty(kjt: Any) -> Any:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        if kjt is None:
            return None
        return KeyedJaggedTensor(
            keys=kjt.keys(),
            values=kjt.values()[:0],
            lengths=kjt.lengths()[:0],
            weights=None if kjt.weights_or_none() is None else kjt.weights()[:0],
        )

    return ModelInput(
        float_features=batch.float_features[:0],
        idlist_features=empty(batch.idlist_features),
        idscore_features=empty(batch.idscore_features),
        label=batch.label[:0],
    )


def _reference(model: torch.nn.Module, steps: list[list[ModelInput | None]], eval_input: ModelInput) -> dict:
    """One process, the unsharded model: per step the ranks' mean loss (an empty batch adds 0), SGD."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batches in steps:
        opt.zero_grad()
        per_rank = [model(b)[0] if b is not None else None for b in batches]
        total = sum((loss for loss in per_rank if loss is not None), torch.zeros(()))
        (total / len(batches)).backward()
        opt.step()
        losses.append([float(loss) if loss is not None else None for loss in per_rank])
    model.eval()
    with torch.no_grad():
        return {"ref_losses": losses, "ref_preds": model(eval_input).tolist()}


def uneven(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    """Train each plan on this rank's batches; rank 0 also trains the reference."""
    steps = _rank_inputs(world_size)
    mine = [b[rank] if b[rank] is not None else _empty_like(next(x for x in b if x is not None)) for b in steps]
    result: dict[str, Any] = _reference(_model(seed=0), steps, _eval_input(0, 1)) if rank == 0 else {}
    for name, plan in PLANS.items():
        module = TorchRecModel(_model(seed=0), "sgd")
        trainer = _trainer(world_size, len(steps), constraints=plan)
        trainer.fit(module, DataLoader(mine, batch_size=None))
        sharding = {s.sharding_type for m in trainer.strategy.sharding_plan.plan.values() for s in m.values()}
        # Every rank predicts the whole held-out batch: the weights, compared.
        preds = torch.cat(trainer.predict(module, DataLoader([_eval_input(0, 1)], batch_size=None))).tolist()
        result[name] = {"losses": module.losses, "preds": preds, "sharding": sorted(sharding)}
    return result


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_batches_of_different_sizes_train_every_sharding_type_like_one_process(tmp_path, world_size):
    results = run_ranks(uneven, world_size, tmp_path)
    ref = results[0]
    assert set(results[0]["mixed"]["sharding"]) == {
        "row_wise",
        "grid_shard",
        "column_wise",
        "table_row_wise",
        "data_parallel",
    }
    assert results[0]["table_wise"]["sharding"] == ["table_wise"]
    for name in PLANS:
        for rank, result in enumerate(results):
            expected = [step[rank] for step in ref["ref_losses"]]
            got = result[name]["losses"]
            for step, (want, have) in enumerate(zip(expected, got, strict=True)):
                if want is None:  # an empty batch: its loss is a mean over nothing
                    assert have != have, (name, rank, step, have)  # NaN
                else:
                    assert have == pytest.approx(want, abs=TOL), (name, rank, step)
            assert result[name]["preds"] == pytest.approx(ref["ref_preds"], abs=TOL), (name, rank)


def padded_gathers(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    """padded_all_gather of pieces of different lengths (one rank with none) against gloo's gather of each piece."""
    import torch.distributed as dist

    from lightning_rec._strategy.uneven_batches import padded_all_gather

    dist.init_process_group("gloo")
    lengths = [3, 0, 5][:world_size]
    mine = torch.arange(lengths[rank] * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank
    pieces = [torch.full((n, 2), -1.0) for n in lengths]
    padded_all_gather(pieces, mine).wait()
    dist.destroy_process_group()
    return {"pieces": [p.tolist() for p in pieces]}


@pytest.mark.dist
def test_padded_all_gather_delivers_each_rank_s_rows_exactly(tmp_path):
    results = run_ranks(padded_gathers, 3, tmp_path)
    expected = [
        (torch.arange(n * 2, dtype=torch.float32).reshape(-1, 2) + 100 * r).tolist() for r, n in enumerate([3, 0, 5])
    ]
    assert all(r["pieces"] == expected for r in results)


# ---------------------------------------------------------------------------------------------------------------
# The user's path: their own click log with an odd row count, `lightning-rec fit` on 2 processes, row-wise tables.
# ---------------------------------------------------------------------------------------------------------------


def _click_log(path: Path, rows: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    users, items = torch.randint(0, 5000, (rows,), generator=g), torch.randint(0, 800, (rows,), generator=g)
    price = torch.rand(rows, generator=g) * 100
    clicked = (torch.rand(rows, generator=g) < 0.3).int()
    lines = ["user_id,item_id,price,clicked"] + [
        f"{u},{i},{p:.2f},{c}" for u, i, p, c in zip(users.tolist(), items.tolist(), price.tolist(), clicked.tolist())
    ]
    path.write_text("\n".join(lines) + "\n")


CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 2
  max_epochs: 2
  enable_checkpointing: false
  enable_progress_bar: false
  logger: false
  strategy:
    class_path: lightning_rec.RecShardStrategy
    init_args:
      constraints:
        t_user_id: {{sharding_types: [row_wise]}}
        t_item_id: {{sharding_types: [table_row_wise]}}
model:
  class_path: lightning_rec.models.DLRMModule
  init_args:
    embedding_dim: 8
    dense_arch_layer_sizes: [16, 8]
    over_arch_layer_sizes: [16, 1]
data:
  class_path: lightning_rec.data.TabularDataModule
  init_args:
    train: {train}
    val: {val}
    batch_size: 64
    stream: {stream}
    schema:
      labels: [{{column: clicked}}]
      dense: [{{column: price, transform: log1p}}]
      sparse:
        - {{column: user_id, ids: hash, num_embeddings: 4001}}
        - {{column: item_id, ids: hash, num_embeddings: 997}}
"""


def _fit_click_log(work: Path, stream: bool, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``lightning-rec fit`` of :data:`CONFIG` on 2,001 training and 301 validation rows of a click log in ``work``."""
    _click_log(work / "train.csv", 2001, seed=1)
    _click_log(work / "val.csv", 301, seed=2)
    config = work / "clicks.yaml"
    config.write_text(CONFIG.format(train=work / "train.csv", val=work / "val.csv", stream=str(stream).lower()))
    return subprocess.run(
        [sys.executable, "-m", "lightning_rec", "fit", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=work,
        timeout=400,
        env=env,
    )


@pytest.fixture(scope="module")
def click_log_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[bool, Future]]:
    """The CLI jobs of :func:`_fit_click_log` (read in memory, streamed) this session tests, side by side
    (tests/helpers/side_by_side.py: each job's ranks import one after the other, on one core)."""
    env = dict(os.environ)  # read here, not in the jobs' threads while a test may be changing it
    streams = selected(request, "test_an_odd_row_count_trains_row_wise_tables_through_the_cli_on_two_ranks", "stream")
    jobs = {s: partial(_fit_click_log, tmp_path_factory.mktemp(f"clicks_stream_{s}"), s, env) for s in streams}
    with side_by_side(jobs) as runs:
        yield runs


@pytest.mark.dist
@pytest.mark.parametrize("stream", [False, True])
def test_an_odd_row_count_trains_row_wise_tables_through_the_cli_on_two_ranks(click_log_runs, stream):
    """2,001 training rows (the ranks' last batches differ by a row), 301 validation rows: before the padded all-gather,
    gloo refused the row-wise backward at the epoch's last batch."""
    out = click_log_runs[stream].result()
    assert out.returncode == 0, out.stderr[-4000:]
    assert "Traceback" not in out.stderr and "invalid tensor size" not in out.stderr


@pytest.mark.dist
def test_pipelined_input_distribution_trains_row_wise_batches_of_different_sizes_as_the_plain_step(tmp_path):
    """TorchRec's train pipeline (``pipeline=True``) reaches the same reduce-scatter: the same losses as without it."""
    from tests.helpers import scenarios

    row_wise = {t: {"sharding_types": ["row_wise"]} for t in ("t_user", "t_item", "t_genre")}
    runs = [
        run_ranks(
            scenarios.train,
            2,
            tmp_path / str(pipeline),
            tag="uneven",
            steps=4,
            batch_size=[9, 4],
            strategy={"constraints": row_wise, "pipeline": pipeline},
        )
        for pipeline in (False, True)
    ]
    assert all(r["plan"][0]["sharding_type"] == "row_wise" for run in runs for r in run)
    for plain, piped in zip(*runs, strict=True):
        assert len(plain["losses"]) == 4
        assert piped["losses"] == pytest.approx(plain["losses"], abs=1e-6)
