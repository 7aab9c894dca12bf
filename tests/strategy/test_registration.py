"""Registration, construction, and errors raised before any distributed work starts (in-process)."""

from __future__ import annotations

import importlib

import lightning as L
import pytest
from torch.utils.data import DataLoader

import lightning_rec
from lightning_rec import EmbeddingOptimizer, RecShardStrategy, TableConstraints
from lightning_rec._strategy.dmp import ShardedState
from lightning_rec._strategy.hook_state import HookState
from tests.helpers.models import RecModel, make_batches


def test_recshard_is_registered_idempotently():
    assert "recshard" in L.pytorch.strategies.StrategyRegistry
    importlib.reload(lightning_rec)
    importlib.reload(lightning_rec)
    assert "recshard" in L.pytorch.strategies.StrategyRegistry
    trainer = L.Trainer(strategy="recshard", accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy).__name__ == "RecShardStrategy"


def test_strategy_object_takes_yaml_shaped_arguments():
    s = RecShardStrategy(
        constraints={"t_user": {"sharding_types": ["COLUMN_WISE"]}},
        topology={"ddr_cap": 2**30, "batch_size": 512},
        embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05},
        bounds_check="error",
    )
    assert s.sharding.constraints["t_user"] == TableConstraints(sharding_types=["column_wise"])
    assert s.sharding.topology.batch_size == 512 and s.sharding.embedding_optimizer.lr == 0.05
    assert s.sharding.fused_params["bounds_check_mode"].name == "FATAL"
    # The configuration is built once and read from there; the strategy does not forward its fields.
    assert not any(
        hasattr(s, name) for name in ("sharder", "constraints", "topology", "embedding_optimizer", "fused_params")
    )
    with pytest.raises(ValueError, match="bounds_check must be one of"):
        RecShardStrategy(bounds_check="sometimes")


def _fit(**kwargs):
    strategy = kwargs.pop("strategy", RecShardStrategy())
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        logger=False,
        max_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **kwargs,
    )
    trainer.fit(RecModel(), DataLoader(make_batches(1, 4, seed=0), batch_size=None))


def test_a_cuda_only_kernel_on_cpu_fails_before_distributed_start():
    import torch.distributed as dist

    with pytest.raises(
        ValueError, match="compute kernel 'fused_uvm' cannot train on CPU; supported there: fused, dense"
    ):
        _fit(strategy=RecShardStrategy(constraints={"t_user": TableConstraints(compute_kernels=["fused_uvm"])}))
    assert not dist.is_initialized()


def test_16_mixed_is_refused_with_a_reason():
    """On CPU Lightning itself swaps 16-mixed for bf16-mixed; on CUDA the strategy must refuse it."""
    import warnings

    import torch.distributed as dist
    from lightning.pytorch.plugins.precision import MixedPrecision

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GradScaler warns that CUDA is absent here
        plugin = MixedPrecision("16-mixed", device="cuda")
    strategy = RecShardStrategy(precision_plugin=plugin)
    with pytest.raises(ValueError, match="16-mixed.*skipped steps would silently half-apply.*bf16-mixed"):
        strategy.setup_environment()
    assert not dist.is_initialized()


def test_a_model_sharded_with_another_fused_optimizer_is_refused():
    sgd = EmbeddingOptimizer("sgd", lr=0.1)
    state = ShardedState(dmp=None, plan=None, embedding_optimizer=sgd)  # what a first `validate` or `fit` left
    sharding = RecShardStrategy().sharding
    sharding.check_sharded_with(state, EmbeddingOptimizer("sgd", lr=0.1), None)  # the same one: trains on
    with pytest.raises(RuntimeError, match="RecShardStrategy: the model was sharded earlier with embedding optimizer"):
        sharding.check_sharded_with(state, EmbeddingOptimizer("adagrad", lr=0.1), None)
    with pytest.raises(RuntimeError, match="HINT: declare it with `configure_embedding_optimizer"):
        sharding.check_sharded_with(state, sgd, {"t_user": (EmbeddingOptimizer("sgd", lr=0.2), None)})


def test_a_backward_without_a_step_is_refused_when_the_next_batch_starts():
    steps = HookState()
    steps.fit_started(check_steps=True)  # setup: fitting a model with tables
    steps.backward_ran()  # pre_backward
    steps.optimizer_stepped()  # optimizer_step
    steps.check_batch_start(1)  # on_train_batch_start: stepped, fine
    steps.backward_ran()
    with pytest.raises(RuntimeError, match="RecShardStrategy: the training batch before batch 2 ran a backward pass"):
        steps.check_batch_start(2)
    steps.fit_started(check_steps=False)  # a new fit, without tables: nothing pending, nothing checked
    steps.backward_ran()
    steps.check_batch_start(3)
