"""The work behind :class:`~lightning_rec.RecShardStrategy`'s lifecycle hooks, as functions of what they need.

- :func:`start_process_group` (``setup_environment``): the process group, gloo on CPU and nccl on CUDA, with the
  strategy's timeout, closed at exit, and over gloo able to train batches of different sizes on each rank
  (:mod:`~lightning_rec._strategy.uneven_batches`); :func:`rank_boards`: where the ranks tell each other of failures and count
  their batches.
- :func:`shard_with_optimizers` (``setup``): the user's optimizers built before sharding (the fused embedding
  optimizer is part of the sharded kernels), the module sharded (or, when it already is, checked against them),
  and, when fitting, fused and dense optimizers combined into one :class:`~lightning_rec._strategy.optim.RecOptimizer`.
- :func:`input_refusals` (``setup``): what the input checks must refuse on this plan (variable-batch inputs).
- :func:`transfer_batch` (``batch_to_device``): a batch checked on the host, copied without blocking, and passed
  through the module's own transfer hooks.

The hooks themselves, in Lightning's order: :mod:`lightning_rec._strategy.recshard`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.plugins import LayerSync
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.optim import Optimizer

from lightning_rec import _compat
from lightning_rec._batch import to_device
from lightning_rec._inputs.checks import InputChecks
from lightning_rec._planner.devices import vbe_refusals
from lightning_rec._strategy.batch_counts import BatchCounts
from lightning_rec._strategy.dmp import ShardedState, prepare_for_optimizers, sharded_state, unfused_table_parameters
from lightning_rec._strategy.faults import FailureBoard, close_process_group_at_exit
from lightning_rec._strategy.optim import RecOptimizer, combine_optimizers
from lightning_rec._strategy.sharding_config import ShardingConfig
from lightning_rec._strategy.uneven_batches import allow_uneven_batches_over_gloo

__all__ = [
    "ShardedSetup",
    "input_refusals",
    "rank_boards",
    "shard_with_optimizers",
    "restart_store",
    "start_process_group",
    "transfer_batch",
]


def start_process_group(
    cluster_environment: ClusterEnvironment, device: torch.device, backend: str | None, timeout: timedelta | None
) -> str:
    """Start the default process group for ``device`` and return its backend (``backend``, or Lightning's default
    for the device: gloo on CPU, nccl on CUDA)."""
    if backend is None:
        backend = _compat._get_default_process_group_backend_for_device(device)
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    store = restart_store(cluster_environment, timeout)
    if store is not None:
        kwargs["store"] = store
    _compat._init_dist_connection(cluster_environment, backend, **kwargs)
    close_process_group_at_exit(timeout)  # a finished job must exit 0, not abort in gloo's threads
    if backend == dist.Backend.GLOO:
        allow_uneven_batches_over_gloo()  # row-wise tables train batches of different sizes on each rank
    return backend


def restart_store(cluster_environment: ClusterEnvironment, timeout: timedelta | None) -> dist.Store | None:
    """Under torchrun, the agent's store seen through a prefix of this attempt (``TORCHELASTIC_RESTART_COUNT``);
    ``None`` elsewhere (the process group makes its own store, as Lightning's ``ddp`` does).

    Why: ``torchrun --max-restarts`` restarts a failed group on the same agent store, which still holds the dead
    attempt's keys, among them its ranks' gloo addresses; a restarted rank that reads one connects to a dead
    process, and the new group hangs or fails (``Gloo connectFullMesh failed ... Connection refused``): 2 of 3
    restarts here, plain torch 2.13 scripts too. Each attempt's keys under its own prefix: 3 of 3 restarted.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or not dist.is_available():
        return None
    store = dist.TCPStore(
        cluster_environment.main_address,
        cluster_environment.main_port,
        cluster_environment.world_size(),
        is_master=False,
        timeout=timeout or timedelta(minutes=30),
    )
    return dist.PrefixStore(f"lightning_rec/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def rank_boards(
    token: str, rank: int, world_size: int, timeout: timedelta | None, owner: str
) -> tuple[FailureBoard | None, BatchCounts | None]:
    """The boards on the default process group's store under ``token`` (a prefix shared by every rank of this run):
    where a failing rank leaves its error for the others (:class:`~lightning_rec._strategy.faults.FailureBoard`),
    and where the ranks count their training batches (:class:`~lightning_rec._strategy.batch_counts.BatchCounts`),
    so that ranks running out of batches at different counts are named, not left to pair their next collectives
    with the others' remaining batches. ``None`` where there is no such board (no process group; one rank)."""
    wait = min(timeout, timedelta(seconds=10)) if timeout is not None else timedelta(seconds=10)
    failures = FailureBoard.for_default_group(token, rank)
    return failures, BatchCounts.for_default_group(token, rank, world_size, wait, owner)


@dataclass
class ShardedSetup:
    """What :func:`shard_with_optimizers` leaves for the strategy.

    Attributes:
        state: the sharded module's state (its ``DistributedModelParallel``, plan, report, ...).
        optimizers: the optimizers Lightning steps when fitting (as
            :func:`~lightning_rec._strategy.optim.combine_optimizers` returns them); empty otherwise.
        lr_scheduler_configs: the schedulers ``configure_optimizers`` returned.
        rec_optimizer: fused and dense optimizers as one (``None`` unless fitting).
    """

    state: ShardedState
    optimizers: list[Optimizer]
    lr_scheduler_configs: list[Any]
    rec_optimizer: RecOptimizer | None


def shard_with_optimizers(
    module: pl.LightningModule,
    sharding: ShardingConfig,
    fitting: bool,
    device: torch.device,
    world_size: int,
    num_processes: int,
    layer_sync: LayerSync | None = None,
) -> ShardedSetup:
    """Build ``module``'s optimizers, settle the fused embedding optimizer, shard ``module`` (unless it already is)
    and, when ``fitting``, combine fused and dense optimizers.

    Args:
        module: the LightningModule (its dense part is materialised on ``device`` before its first sharding; if it
            is already sharded, e.g. validate then fit, it is not sharded again).
        sharding: the strategy's sharding configuration.
        fitting: whether the Trainer is fitting (only then are optimizers needed and combined).
        device, world_size, num_processes: the strategy's device and ranks.
        layer_sync: the Trainer's ``sync_batchnorm`` plugin, applied before the first sharding when fitting.
    """
    state = sharded_state(module)
    if fitting and state is None and layer_sync is not None:
        # Trainer(sync_batchnorm=True), as Lightning's ddp applies it: before the optimizers see the parameters.
        layer_sync.apply(module)  # converts the BatchNorm layers in place (the root is no BatchNorm)
    tables = sharding.inventory(module)  # once per setup: every step below reads it
    is_embedding = prepare_for_optimizers(module, tables, device, state)
    optimizers: list[Optimizer] = []
    lr_scheduler_configs: list[Any] = []
    # `configure_optimizers` is called before sharding: the fused optimizer is part of the sharded kernels.
    if fitting or (state is None and is_overridden("configure_optimizers", module)):
        optimizers, lr_scheduler_configs = _compat._init_optimizers_and_lr_schedulers(module)
    emb_opt, lr_source, per_table = sharding.embedding_optimizer_for(
        module, optimizers, is_embedding, device.type, tables
    )

    if state is None:
        state = sharding.shard(
            module,
            emb_opt,
            world_size=world_size,
            num_processes=num_processes,
            device=device,
            per_table=per_table,
            tables=tables,
        )
    elif fitting:
        sharding.check_sharded_with(state, emb_opt, per_table)  # the fused optimizer is in the kernels
    if not fitting:
        return ShardedSetup(state, [], lr_scheduler_configs, None)
    rec_optimizer, optimizers = combine_optimizers(
        state.dmp.fused_optimizer,
        optimizers,
        named_parameters=dict(module.named_parameters()),
        is_embedding=is_embedding,
        lr_source=lr_source,
        table_params=unfused_table_parameters(module, state),
        embedding_optimizer=state.embedding_optimizer,
        per_table=per_table,
    )
    return ShardedSetup(state, optimizers, lr_scheduler_configs, rec_optimizer)


def input_refusals(state: ShardedState, device_type: str, world_size: int) -> dict[str, str]:
    """The sharded modules that cannot train on a variable-batch KJT with ``state``'s plan and optimizers, and why
    (see :func:`~lightning_rec._planner.devices.vbe_refusals`)."""
    names = sorted({o.name for o in [state.embedding_optimizer, *state.table_optimizers.values()]})
    return vbe_refusals(state.plan, names, device_type, world_size)


def transfer_batch(
    module: pl.LightningModule,
    batch: Any,
    device: torch.device,
    dataloader_idx: int,
    checks: InputChecks,
    batch_hooks: tuple[bool, bool],
) -> Any:
    """Check ``batch`` on the host, copy it to ``device`` without blocking (or through the module's
    ``transfer_batch_to_device`` override) and run its ``on_after_batch_transfer`` override, as Lightning calls them.

    Args:
        batch_hooks: whether ``transfer_batch_to_device`` and ``on_after_batch_transfer`` are overridden (see
            :func:`lightning_rec._batch.custom_batch_hooks`).
    """
    checked = checks.check_host(batch)
    custom_transfer, custom_after = batch_hooks
    if custom_transfer:
        batch = _compat.call_batch_hook(module, "transfer_batch_to_device", batch, device, dataloader_idx)
    else:
        batch = to_device(batch, device)
    checks.trust(checked, batch)
    if custom_after:
        batch = _compat.call_batch_hook(module, "on_after_batch_transfer", batch, dataloader_idx)
    return batch
