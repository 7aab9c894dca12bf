"""Reference models: construction errors, shapes, and metrics that do not depend on the number of ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_rec import RecShardStrategy
from lightning_rec.data import RecDataset, SparseFeature
from lightning_rec.data.base import Jagged
from lightning_rec.data.movielens import MovieLensDataModule
from lightning_rec.models import DLRMModule, build_dlrm
from lightning_rec.testing import deterministic_init
from tests.helpers import zoo_dlrm
from tests.helpers.data import movielens_dir
from tests.helpers.dist import run_ranks
from tests.helpers.zoo import check_case

FEATURES = [SparseFeature("user", 10), SparseFeature("genre", 5, multi_hot=True)]


def test_build_dlrm_checks_layer_sizes() -> None:
    with pytest.raises(ValueError, match=r"last dense layer.*embedding_dim=8.*HINT"):
        build_dlrm(FEATURES, 2, embedding_dim=8, dense_arch_layer_sizes=[16, 4])
    with pytest.raises(ValueError, match="one logit"):
        build_dlrm(FEATURES, 2, embedding_dim=8, dense_arch_layer_sizes=[8], over_arch_layer_sizes=[4, 2])
    with pytest.raises(ValueError, match="interaction"):
        build_dlrm(FEATURES, 2, embedding_dim=8, dense_arch_layer_sizes=[8], interaction="cross")  # type: ignore[arg-type]


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_dlrm_module_forward_and_loss_on_unsharded_tables(interaction: str) -> None:
    model = DLRMModule(
        FEATURES, 2, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1], interaction=interaction
    )
    ebc = model.model.sparse_arch.embedding_bag_collection
    assert all(p.is_meta for p in ebc.parameters()), "tables must stay on meta until the strategy shards them"
    model.model.sparse_arch.embedding_bag_collection = type(ebc)(tables=ebc.embedding_bag_configs())
    data = RecDataset(
        torch.randn(6, 2),
        torch.tensor([1.0, 0, 1, 0, 1, 0]),
        {"user": torch.arange(6), "genre": Jagged.from_lists([[1], [2, 3], [], [4], [0, 1, 2], [3]])},
    )
    batch = data[torch.arange(6)]
    logits = model(batch)
    assert logits.shape == (6,)
    loss = model.training_step(batch, 0)
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.dist
def test_validation_metrics_equal_on_one_and_two_ranks(tmp_path: Path) -> None:
    """The same weights and the same validation rows give the same AUROC/NE/log loss/accuracy whether the rows
    are split over 2 processes (sharded tables, metric states synced) or seen by one."""
    data_dir = str(movielens_dir())
    one = run_ranks(validate_movielens, 1, tmp_path / "one", data_dir=data_dir)[0]
    two = run_ranks(validate_movielens, 2, tmp_path / "two", data_dir=data_dir)
    assert two[0] == pytest.approx(two[1], abs=1e-7), "ranks must report the same synced metrics"
    assert set(one) >= {"val/auroc", "val/ne", "val/log_loss", "val/accuracy"}
    assert one == pytest.approx(two[0], abs=1e-5)
    assert abs(one["val/auroc"] - 0.5) > 1e-4, "predictions should not be constant"


@pytest.mark.dist
def test_dlrm_dcn_trains_like_plain_pytorch_pipelined_and_resharded(tmp_path: Path) -> None:
    """The zoo harness (tests/helpers/zoo.py): 1 and 2 processes vs plain PyTorch, pipelined, 2 <-> 1, loaded."""
    check_case(tmp_path, zoo_dlrm)


# ------------------------------------------------------------------------------------------------------------
# What each rank runs (run_ranks imports it from this module).
# ------------------------------------------------------------------------------------------------------------

# Real sharding on 2 ranks: one column-wise, one table-wise table; the planner decides the rest.
MOVIELENS_PLAN = {"t_user_id": {"sharding_types": ["column_wise"]}, "t_item_id": {"sharding_types": ["table_wise"]}}


class _InitBeforeValidation(L.Callback):
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        deterministic_init(pl_module)


def validate_movielens(
    rank: int, world_size: int, out_dir: Path, data_dir: str, interaction: str = "dcn"
) -> dict[str, Any]:
    """Validate a DLRM with plan-independent weights on MovieLens; report the epoch metrics."""
    dm = MovieLensDataModule(data_dir, download=False, batch_size=700)
    model = DLRMModule(
        dm.sparse_features,
        dm.num_dense_features,
        embedding_dim=8,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
        interaction=interaction,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=RecShardStrategy(constraints=MOVIELENS_PLAN),
        callbacks=[_InitBeforeValidation()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(model, dm)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}
