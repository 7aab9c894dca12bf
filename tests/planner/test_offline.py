"""lightning_rec._planner.offline: a cluster's plan made here, with the fused optimizer fit would derive."""

from __future__ import annotations

import pytest
import torch

import lightning_rec._planner.inventory as inventory
from lightning_rec._planner.cluster import Cluster
from lightning_rec._planner.fit import DoesNotFit
from lightning_rec._planner.offline import build_on_meta, plan_cluster, planning_optimizer
from lightning_rec._strategy.sharding_config import ShardingConfig
from tests.planner.tables import Tiny


def test_the_model_is_walked_once_and_planned_with_its_own_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    walks = []
    walk = inventory.embedding_modules
    monkeypatch.setattr(inventory, "embedding_modules", lambda *a: walks.append(a) or walk(*a))
    report = plan_cluster(Tiny(), ShardingConfig.from_arguments(), Cluster(1, 2, "cpu"))
    assert len(walks) == 1, "one inventory, passed down"
    assert report.world_size == 2 and report.estimates_available
    emb_opt, per_table = planning_optimizer(Tiny(), ShardingConfig.from_arguments(), "cpu")
    assert (emb_opt.name, emb_opt.lr, per_table) == ("adagrad", 0.1, None), "from configure_optimizers"


def test_a_configure_optimizers_that_needs_a_trainer_is_skipped_with_a_note() -> None:
    class NeedsTrainer(Tiny):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            raise RuntimeError("no trainer")

    notes: list[str] = []
    emb_opt, _ = planning_optimizer(NeedsTrainer(), ShardingConfig.from_arguments(), "cpu", warn=notes.append)
    assert len(notes) == 1 and "did not run without a Trainer (RuntimeError: no trainer)" in notes[0]


def test_a_model_too_big_raises_does_not_fit_and_build_on_meta_allocates_nothing() -> None:
    model = build_on_meta(lambda: Tiny(rows=10_000_000, dim=128))
    assert all(p.device == torch.device("meta") for p in model.parameters())
    with pytest.raises(DoesNotFit, match=r"does not fit 1 x 1 a100-40g") as caught:
        plan_cluster(model, ShardingConfig.from_arguments(), Cluster(1, 1, preset="a100-40g", hbm_gb=1, ddr_gb=1),
                     candidates=[Cluster(1, 1, preset="a100-40g", hbm_gb=1, ddr_gb=1)])  # fmt: skip
    assert list(caught.value.needs)[0] == "item"
