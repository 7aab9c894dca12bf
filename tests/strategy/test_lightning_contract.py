"""Lightning's contract where recshard used to break it. MPS is refused at ``Trainer(...)`` as Lightning refuses
every DDP-family strategy there. After ``fit`` a module is an ordinary object again: ``torch.save(model)``,
``copy.deepcopy(model)`` and pickling ``trainer.model`` work for a module without tables on 1 and 2 ranks, as under
``ddp`` (no process group or other runtime state is stored on the user's module); a module whose tables TorchRec
sharded refuses in one line naming the way to an unsharded copy (TorchRec's sharded modules cannot be pickled)."""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec import RecLightningModule, RecShardStrategy
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.dist import run_ranks


class Dense(RecLightningModule):
    """No tables: an MLP, as the users of EMA or model soups write one."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: nn.Module, data: list[Any], world_size: int) -> L.Trainer:
    trainer = L.Trainer(
        strategy=RecShardStrategy(), accelerator="cpu", devices=world_size, max_steps=2, **QUIET_TRAINER
    )
    trainer.fit(module, DataLoader(data, batch_size=None))
    return trainer


def _round_trips(module: nn.Module, trainer: L.Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """The state dicts of what ``torch.save(model)``, ``copy.deepcopy(model)`` and pickling ``trainer.model``
    give back."""
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    copies = {
        "torch.save": torch.load(buffer, weights_only=False),
        "deepcopy": copy.deepcopy(module),
        "pickle(trainer.model)": pickle.loads(pickle.dumps(trainer.model)),
    }
    return {name: {k: v.detach().clone() for k, v in c.state_dict().items()} for name, c in copies.items()}


def tableless(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    """Fit :class:`Dense` on ``world_size`` ranks; every copy of it must hold its trained weights."""
    L.seed_everything(0)
    module = Dense()
    data = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    trainer = _fit(module, data, world_size)
    want = {k: v.clone() for k, v in module.state_dict().items()}
    copies = _round_trips(module, trainer)
    result = {
        name: all(torch.equal(got[k], want[k]) for k in want) and set(got) == set(want) for name, got in copies.items()
    }
    # The copy is a module of its own: trained further by another Trainer, it moves as the original does.
    twin = copy.deepcopy(module)
    _fit(module, data, world_size)
    _fit(twin, data, world_size)
    result["trains like the original"] = all(torch.equal(twin.state_dict()[k], module.state_dict()[k]) for k in want)
    result["trained"] = not all(torch.equal(module.state_dict()[k], want[k]) for k in want)
    return result


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_module_without_tables_pickles_and_copies_after_fit(tmp_path, world_size):
    ranks = run_ranks(tableless, world_size, tmp_path)
    for result in ranks:
        assert all(result.values()) and len(result) == 5, result


class Tables(Dense):
    def __init__(self) -> None:
        super().__init__()
        config = EmbeddingBagConfig(name="t_item", embedding_dim=4, num_embeddings=10, feature_names=["item"])
        self.ebc = EmbeddingBagCollection(tables=[config], device=torch.device("meta"))
        self.over = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.over(self.ebc(batch).values()).pow(2).mean()


@pytest.mark.dist
def test_a_module_with_sharded_tables_names_the_way_to_an_unsharded_copy(tmp_path):
    module = Tables()
    kjt = KeyedJaggedTensor(keys=["item"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2]))
    trainer = _fit(module, [kjt, kjt], 1)
    for attempt in (lambda: torch.save(module, io.BytesIO()), lambda: copy.deepcopy(module)):
        with pytest.raises(TypeError, match=r"Tables holds tables sharded by TorchRec \(ebc\).*load_module"):
            attempt()
    with pytest.raises(TypeError, match=r"load_module"):
        pickle.dumps(trainer.model)


@pytest.mark.parametrize("accelerator", ["mps", "auto"])
def test_mps_is_refused_when_the_trainer_is_built_with_lightnings_words(monkeypatch, accelerator):
    """On a Mac (MPS available), ``Trainer(strategy="recshard")`` refuses MPS, chosen or picked by ``"auto"``, with
    the message Lightning gives ``ddp`` there."""
    from lightning.fabric.accelerators import mps as fabric_mps
    from lightning.pytorch.accelerators import MPSAccelerator

    monkeypatch.setattr(MPSAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(fabric_mps.MPSAccelerator, "is_available", staticmethod(lambda: True))
    words = r"strategies from the DDP family are not supported on the MPS accelerator. Either explicitly set"
    with pytest.raises(ValueError, match=words):
        L.Trainer(strategy="recshard", accelerator=accelerator, devices=1)
    L.Trainer(strategy="recshard", accelerator="cpu", devices=1, logger=False)  # CPU is still fine


def test_a_checkpoint_io_is_refused_in_lightnings_words_not_ignored():
    """recshard writes sharded checkpoint directories itself: a ``CheckpointIO`` (the argument or a plugin) would
    be silently ignored, so it is refused, as Lightning's FSDP and ModelParallel strategies say."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    words = r"`RecShardStrategy` does not use the `CheckpointIO`"
    with pytest.raises(ValueError, match=words + r".*`AsyncCheckpointIO` would be ignored"):
        RecShardStrategy(checkpoint_io=AsyncCheckpointIO())
    with pytest.raises(ValueError, match=words):
        L.Trainer(strategy="recshard", accelerator="cpu", devices=1, plugins=[AsyncCheckpointIO()], logger=False)
    with pytest.raises(TypeError, match=r"storage_options=...\)` is not supported because `RecShardStrategy` does"):
        RecShardStrategy().save_checkpoint({}, "unused", storage_options={})
    trainer = L.Trainer(strategy=RecShardStrategy(checkpoint_io=TorchCheckpointIO()), accelerator="cpu", logger=False)
    assert isinstance(trainer.strategy.checkpoint_io, TorchCheckpointIO)  # Lightning's default is fine
