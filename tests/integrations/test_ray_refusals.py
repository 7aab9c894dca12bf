"""lightning_rec.integrations.ray refuses what cannot work, in one line, before any rank starts, without starting
Ray (the fast tier): another strategy, a Trainer built outside Ray Train, a bad report interval, Ray not installed.
What works under Ray is tests/integrations/test_ray.py (the slow tier)."""

from __future__ import annotations

import sys

import lightning as L
import pytest
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_rec.integrations.ray import RayTrainReportCallback, prepare_trainer, restored_checkpoint


def test_prepare_trainer_refuses_another_strategy():
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=1, logger=False)
    with pytest.raises(ValueError, match=r"strategy is DDPStrategy, not RecShardStrategy.*HINT"):
        prepare_trainer(trainer)


def test_prepare_trainer_refuses_a_trainer_built_outside_ray_train():
    trainer = L.Trainer(strategy="recshard", accelerator="cpu", devices=1, logger=False)
    # Outside a Ray Train worker the strategy keeps Lightning's environment: prepare_trainer says so.
    assert type(trainer.strategy.cluster_environment) is LightningEnvironment
    with pytest.raises(
        ValueError, match=r"LightningEnvironment, not Ray's RayLightningEnvironment.*train_loop_per_worker"
    ):
        prepare_trainer(trainer)


@pytest.mark.parametrize("every", [-1, 2.5, True])
def test_the_report_interval_is_a_count_of_steps(every):
    with pytest.raises(ValueError, match=rf"every_n_train_steps={every!r}; expected an int >= 0"):
        RayTrainReportCallback(every_n_train_steps=every)


def test_the_callback_refuses_another_strategy_at_setup():
    callback = RayTrainReportCallback()
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=1, logger=False, callbacks=[callback])
    with pytest.raises(ValueError, match="RayTrainReportCallback: the Trainer's strategy is DDPStrategy"):
        callback.setup(trainer, L.LightningModule(), "fit")


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    for name in [n for n in sys.modules if n == "ray" or n.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as when it is not installed
    with pytest.raises(
        ImportError, match=r'needs Ray Train, which is not installed.*pip install "lightning_rec\[ray\]"'
    ):
        with restored_checkpoint():
            pass
