"""The model-zoo harness: a shipped model trains like plain PyTorch on 1 and 2 processes, pipelined or not, and
predicts the same after resharding 2 <-> 1 and after loading its checkpoint unsharded.

A model contributes one :class:`ZooCase`, as the module-level name ``CASE`` of ``tests/helpers/zoo_<model>.py``, and
one test::

    def test_trains_like_plain_pytorch_pipelined_and_resharded(tmp_path):
        check_case(tmp_path, zoo_deepfm)

What :func:`check_case` runs (3 launches through ``tests.helpers.dist.run_ranks`` of the scenarios at the end of
this module: the 2-process one on real gloo ranks, the 1-process ones in the test's own process):

1. 1 process: ``fit`` (plan ``constraints[1]``), then ``fit`` again from the same start with ``pipeline=True``,
   save a checkpoint, predict the held-out batch;
2. 2 processes, each taking its ``share`` of every whole batch: the same, plus predict from the 1-process
   checkpoint (1 -> 2);
3. 1 process predicts from the 2-process checkpoint (2 -> 1).

and asserts, to ``tol``: per-step losses (the mean of the ranks' losses with 2) equal a plain-PyTorch reference
(the unsharded module, ``case.loss`` on whole batches, ``case.optimizers``); pipelined losses equal non-pipelined,
and the pipelined fits ran TorchRec's pipelined forward in every sharded module at every step on every rank;
predictions (the ranks' shares concatenated) equal the reference's, before and after resharding; and the module
class's ``load_from_checkpoint(<2-process checkpoint>)`` predicts the same in this (non-distributed) process.

Every run starts from the same weights: :func:`seeded_module` builds the module after ``L.seed_everything(0)``
(dense layers) and gives every table seeded rows through :func:`lightning_rec._pretrained.load_rows`.

The reference runs on rank 0 before ``fit`` creates the process group: a loss that gathers across ranks (in-batch
negatives) must fall back to the local batch when ``torch.distributed`` is not initialised.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchrec.optim import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec import RecShardStrategy
from lightning_rec._pretrained import load_rows, table_holders
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.dist import run_ranks
from tests.helpers.models import sharded_forwards


@dataclass
class ZooCase:
    """What the harness needs to know about one model.

    Args:
        build: a fresh module (a ``RecLightningModule`` whose ``training_step`` returns the loss and whose
            ``predict_step`` returns a tensor or a dict of tensors). Called after ``L.seed_everything(0)``; tables
            may be on meta (they get seeded rows).
        batches: ``steps`` whole global batches (CPU; an even number of rows each).
        heldout: one whole batch to predict (an even number of rows).
        share: ``(whole batch, rank, world_size) -> this rank's contiguous part``.
        loss: ``(unsharded module, whole batch) -> loss``: what ``training_step`` computes, in plain PyTorch.
        optimizers: ``unsharded module -> [torch optimizers]`` equal to what the module trains with (e.g. Adam for
            the dense layers and ``torchrec.optim.RowWiseAdagrad`` for the tables, FBGEMM's exact row-wise Adagrad).
        constraints: world size -> the plan's per-table constraints (make 2 really shard: several types).
        steps: training steps.
        tol: absolute tolerance of every comparison.
    """

    build: Callable[[], nn.Module]
    batches: Callable[[int], list[Any]]
    heldout: Callable[[], Any]
    share: Callable[[Any, int, int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    optimizers: Callable[[nn.Module], list[torch.optim.Optimizer]]
    constraints: dict[int, dict[str, Any]] = field(default_factory=dict)
    steps: int = 4
    tol: float = 1e-5


def adam_and_rowwise_adagrad(
    module: nn.Module, tables: list[nn.Parameter], dense_lr: float, table_lr: float, table_eps: float
) -> list[torch.optim.Optimizer]:
    """Plain ``Adam`` on every parameter but ``tables``, and ``torchrec.optim.RowWiseAdagrad`` (FBGEMM's exact row-wise
    Adagrad, in plain PyTorch) on ``tables``: what the shipped models train with."""
    ids = {id(p) for p in tables}
    dense = [p for p in module.parameters() if id(p) not in ids]
    return [torch.optim.Adam(dense, lr=dense_lr), RowWiseAdagrad(tables, lr=table_lr, eps=table_eps)]


def load_case(name: str) -> ZooCase:
    """``"package.module:NAME"`` -> the :class:`ZooCase` it names."""
    module, attr = name.split(":")
    return getattr(importlib.import_module(module), attr)


def seeded_module(case: ZooCase) -> nn.Module:
    """``case.build()`` after ``L.seed_everything(0)``, every table given rows drawn from a seed of its name."""
    L.seed_everything(0, verbose=False)
    module = case.build()
    rows = {}
    for name, where in table_holders(module).items():
        _, _, num_rows, dim = where[0]
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        rows[name] = torch.randn(num_rows, dim, generator=g) * 0.1
    load_rows(module, rows)
    return module


def flatten(prediction: Any) -> torch.Tensor:
    """A prediction (tensor, or dict of tensors: sorted keys) as one ``(rows, -1)`` float tensor."""
    if isinstance(prediction, Mapping):
        parts = [flatten(prediction[k]) for k in sorted(prediction)]
        return torch.cat(parts, dim=1)
    t = prediction.detach().float().cpu()
    return t.reshape(t.shape[0], -1)


def reference(case: ZooCase, module: nn.Module) -> dict[str, Any]:
    """Plain PyTorch on the unsharded module: per-step losses on whole batches and the held-out predictions."""
    module = copy.deepcopy(module)
    optimizers = case.optimizers(module)
    losses = []
    for batch in case.batches(case.steps):
        for opt in optimizers:
            opt.zero_grad()
        loss = case.loss(module, batch)
        loss.backward()
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
    return {"losses": losses, "predictions": predict_unsharded(module, case.heldout()).tolist()}


@torch.no_grad()
def predict_unsharded(module: nn.Module, batch: Any) -> torch.Tensor:
    """``predict_step`` of an unsharded module in eval mode, as ``trainer.predict`` runs it."""
    module.eval()
    return flatten(module.predict_step(batch, 0))


def slice_kjt(kjt: KeyedJaggedTensor, start: int, end: int) -> KeyedJaggedTensor:
    """Samples ``start:end`` of every key of ``kjt`` (values, lengths and weights)."""
    keys, batch = kjt.keys(), kjt.stride()
    lengths = kjt.lengths().reshape(len(keys), batch)
    offsets = kjt.offsets()
    spans = [(int(offsets[k * batch + start]), int(offsets[k * batch + end])) for k in range(len(keys))]
    values = torch.cat([kjt.values()[a:b] for a, b in spans])
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=values,
        lengths=lengths[:, start:end].reshape(-1),
        weights=None if weights is None else torch.cat([weights[a:b] for a, b in spans]),
    )


def share_rows(batch: Any, rank: int, world_size: int) -> Any:
    """A rank's contiguous part of a whole batch: a TorchRec/lightning_rec ``Batch``, a KJT, a tensor (first dim), or a
    dict/tuple/list of those. Every part must hold the same number of samples."""
    if isinstance(batch, KeyedJaggedTensor):
        per = batch.stride() // world_size
        return slice_kjt(batch, rank * per, (rank + 1) * per)
    if isinstance(batch, torch.Tensor):
        per = batch.shape[0] // world_size
        return batch[rank * per : (rank + 1) * per]
    if isinstance(batch, Mapping):
        return {k: share_rows(v, rank, world_size) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(share_rows(v, rank, world_size) for v in batch)
    if dataclasses.is_dataclass(batch):
        return type(batch)(
            **{f.name: share_rows(getattr(batch, f.name), rank, world_size) for f in dataclasses.fields(batch)}
        )
    return batch


def _mean(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [sum(step) / len(step) for step in zip(*(r[key] for r in runs))]


def _joined(runs: list[dict[str, Any]], key: str) -> list[float]:
    return _flat([row for r in runs for row in r[key]])


def _flat(rows: list[list[float]]) -> list[float]:
    """Rows of predictions as one list (``pytest.approx`` compares flat sequences)."""
    return [x for row in rows for x in row]


def check_case(tmp_path: Path, case_module: ModuleType) -> None:
    """Run the three launches described in the module docstring on ``case_module.CASE`` and assert everything it
    lists."""
    case_name = f"{case_module.__name__}:CASE"
    case = load_case(case_name)
    tol = case.tol
    one = run_ranks(fit, 1, tmp_path / "one", case=case_name, save="ckpt")
    two = run_ranks(
        fit,
        2,
        tmp_path / "two",
        case=case_name,
        save="ckpt",
        predict_ckpt=str(tmp_path / "one" / "ckpt"),
    )
    back = run_ranks(predict, 1, tmp_path / "back", case=case_name, ckpt=str(tmp_path / "two" / "ckpt"))
    ref = one[0]["reference"]
    assert len(ref["losses"]) == case.steps and len(set(ref["losses"])) > 1, "the reference must train"

    assert one[0]["losses"] == pytest.approx(ref["losses"], abs=tol), "1 process vs plain PyTorch"
    assert _mean(two, "losses") == pytest.approx(ref["losses"], abs=tol), "2 processes (mean of ranks) vs plain PyTorch"
    for runs in (one, two):
        for r in runs:
            assert r["pipelined_losses"] == pytest.approx(r["losses"], abs=tol), "pipelined vs not"
            # ... and the pipelined fit really pipelined: at every step on every rank, every sharded embedding
            # module ran TorchRec's PipelinedForward (inputs distributed ahead), not a silent fallback to its own.
            for key, forward in (("forwards", "method"), ("pipelined_forwards", "PipelinedForward")):
                steps = r[key]
                assert len(steps) == len(r["losses"]) and all(steps), f"{key}: no sharded module recorded"
                assert all(set(step.values()) == {forward} for step in steps), f"{key}: {steps}"

    expected = _flat(ref["predictions"])
    assert _flat(one[0]["predictions"]) == pytest.approx(expected, abs=tol)
    assert _joined(two, "predictions") == pytest.approx(expected, abs=tol)
    # The 1 -> 2 run took the 1-process checkpoint, trained from the same start: the same predictions.
    assert _joined(two, "from_ckpt") == pytest.approx(_joined(one, "predictions"), abs=tol), "1 -> 2 processes"
    assert _flat(back[0]["from_ckpt"]) == pytest.approx(_joined(two, "predictions"), abs=tol), "2 -> 1 process"

    # The checkpoint directory loads unsharded in this process (no process group) and predicts the same.
    module = seeded_module(case)
    loaded = type(module).load_from_checkpoint(tmp_path / "two" / "ckpt")
    assert _flat(predict_unsharded(loaded, case.heldout()).tolist()) == pytest.approx(expected, abs=tol), (
        "load_from_checkpoint"
    )


# ------------------------------------------------------------------------------------------------------------
# What each rank runs (run_ranks imports them from this module).
# ------------------------------------------------------------------------------------------------------------


class _Losses(L.Callback):
    """Each step's loss, as ``training_step`` returned it (automatic or manual optimization), and the forward every
    sharded embedding module ran in it (:func:`~tests.helpers.models.sharded_forwards`)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.forwards: list[dict[str, str]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        self.forwards.append(sharded_forwards(pl_module))


def _trainer(case: ZooCase, world_size: int, pipeline: bool = False) -> L.Trainer:
    return L.Trainer(
        strategy=RecShardStrategy(constraints=case.constraints.get(world_size), pipeline=pipeline),
        accelerator="cpu",
        devices=world_size,
        max_steps=case.steps,
        limit_val_batches=0,
        **QUIET_TRAINER,
    )


def _loader(batches: list[Any]) -> DataLoader:
    return DataLoader(batches, batch_size=None, collate_fn=lambda b: b)


def _predict(
    trainer: L.Trainer, module: L.LightningModule, case: ZooCase, rank: int, world_size: int, ckpt: str | None = None
) -> list[list[float]]:
    shares = _loader([case.share(case.heldout(), rank, world_size)])
    return torch.cat([flatten(p) for p in trainer.predict(module, shares, ckpt_path=ckpt)]).tolist()


def _fit(case: ZooCase, rank: int, world_size: int, pipeline: bool) -> tuple:
    module = seeded_module(case)
    losses = _Losses()
    trainer = _trainer(case, world_size, pipeline)
    trainer.callbacks.append(losses)
    trainer.fit(module, _loader([case.share(b, rank, world_size) for b in case.batches(case.steps)]))
    return trainer, module, losses


def fit(
    rank: int, world_size: int, out_dir: Path, case: str, save: str | None = None, predict_ckpt: str | None = None
) -> dict[str, Any]:
    """Fit from the seeded start (rank 0 also runs the plain-PyTorch reference first), fit again pipelined, save,
    predict the held-out share; with ``predict_ckpt``, also predict from that checkpoint with a fresh module. Both
    fits report each step's loss and the forward each sharded embedding module ran in it."""
    zoo = load_case(case)
    result: dict[str, Any] = {}
    if rank == 0:
        result["reference"] = reference(zoo, seeded_module(zoo))
    trainer, module, plain = _fit(zoo, rank, world_size, pipeline=False)
    result["losses"], result["forwards"] = plain.losses, plain.forwards
    result["predictions"] = _predict(trainer, module, zoo, rank, world_size)
    if save:
        trainer.save_checkpoint(out_dir / save)
    _, _, piped = _fit(zoo, rank, world_size, pipeline=True)
    result["pipelined_losses"], result["pipelined_forwards"] = piped.losses, piped.forwards
    if predict_ckpt:
        result["from_ckpt"] = _from_ckpt(zoo, rank, world_size, predict_ckpt)
    return result


def _from_ckpt(zoo: ZooCase, rank: int, world_size: int, ckpt: str) -> list[list[float]]:
    L.seed_everything(1, verbose=False)  # other dense weights: they must come from the checkpoint
    module = zoo.build()
    return _predict(_trainer(zoo, world_size), module, zoo, rank, world_size, ckpt=ckpt)


def predict(rank: int, world_size: int, out_dir: Path, case: str, ckpt: str) -> dict[str, Any]:
    """A fresh module predicts the held-out share from ``ckpt``."""
    return {"from_ckpt": _from_ckpt(load_case(case), rank, world_size, ckpt)}
