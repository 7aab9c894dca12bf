"""The models the planner's unit tests plan: built on ``meta`` (nothing allocated), planned in this process (no process
group, no fit). One module so that each test file of ``tests/planner/`` (one per planner module) reads the same."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

from lightning_rec._planner.inventory import TableInventory
from lightning_rec._planner.request import PlanRequest
from lightning_rec._planner.sharders import make_sharders
from lightning_rec.config import EmbeddingOptimizer

META = torch.device("meta")


class Tiny(nn.Module):
    """Three pooled tables (one 6 wide: not a multiple of 4), one sequence table, a dense head."""

    def __init__(self, rows: int = 100, dim: int = 8) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="user", embedding_dim=dim, num_embeddings=rows, feature_names=["u"]),
                EmbeddingBagConfig(name="item", embedding_dim=dim, num_embeddings=rows * 4, feature_names=["i"]),
                EmbeddingBagConfig(name="odd", embedding_dim=6, num_embeddings=10, feature_names=["o"]),
            ],
            device=META,
        )
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name="hist", embedding_dim=dim, num_embeddings=rows, feature_names=["h"])],
            device=META,
        )
        self.head = nn.Linear(2 * dim + 6, 1, device=META)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


def position_weighted() -> nn.Module:
    """A position-weighted EBC: its position weights are dense parameters inside an embedding module."""
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="pw", embedding_dim=4, num_embeddings=20, feature_names=["p"])],
        is_weighted=True,
        device=META,
    )
    fp = PositionWeightedModuleCollection({"p": 5}, device=META)
    return nn.Sequential(FeatureProcessedEmbeddingBagCollection(ebc, fp))


def request(
    model: nn.Module, world_size: int = 2, device_type: str = "cpu", optimizer: str = "sgd", **over: Any
) -> PlanRequest:
    """A request for ``model`` on ``world_size`` ranks of one host, its tables trained by ``optimizer``."""
    fused = EmbeddingOptimizer(optimizer, lr=0.1).to_fused_params()
    fields: dict[str, Any] = dict(
        world_size=world_size, local_world_size=world_size, device_type=device_type, sharders=make_sharders(fused)
    )
    return PlanRequest(TableInventory.of(model), **{**fields, **over})
