"""Ray Train, as Ray documents Lightning: recshard inside a ``TorchTrainer``'s ``train_loop_per_worker``.

Plain ``Trainer(strategy="recshard", devices="auto")`` works there: inside a Ray Train worker the strategy takes its
ranks from Ray's ``RayLightningEnvironment`` and its device from ``ray.train.torch.get_device()``, as Ray's
``RayDDPStrategy`` does (nothing to pass; ``plugins=[RayLightningEnvironment()]`` is accepted too). What Ray's
Lightning helpers cannot do for a sharded model, this module does:

* :class:`RayTrainReportCallback` in place of Ray's callback of that name: saves each checkpoint as recshard's sharded
  directory (every rank writes its shards) and reports that directory to Ray
  (``ray.train.report(metrics, checkpoint=Checkpoint.from_directory(...))``), so Ray keeps it in its storage and
  restores it after a failure;
* :func:`restored_checkpoint`: the ``ckpt_path`` of the checkpoint Ray restores the run from
  (``ray.train.get_checkpoint()``), or ``None`` on a first start;
* :func:`prepare_trainer` in place of ``ray.train.lightning.prepare_trainer`` (which refuses every strategy but
  Ray's own): checks that the Trainer runs recshard on Ray's ranks, before any rank starts.

Ray is an optional dependency (``pip install "lightning_rec[ray]"``), imported only when these are used. Every worker
must see the directory the checkpoints are written to before Ray copies them (``dirpath``: a temporary folder on
one node; a shared filesystem across nodes), as every rank of a recshard checkpoint writes its own shards into it.

Example::

    import lightning as L
    import ray.train
    from ray.train.torch import TorchTrainer

    from lightning_rec.integrations.ray import RayTrainReportCallback, prepare_trainer, restored_checkpoint

    def train_loop_per_worker(config):
        datamodule, model = ..., ...
        trainer = L.Trainer(strategy="recshard", devices="auto", max_epochs=2, enable_checkpointing=False,
                            callbacks=[RayTrainReportCallback()])
        trainer = prepare_trainer(trainer)
        with restored_checkpoint() as ckpt_path:  # None on a first start
            trainer.fit(model, datamodule, ckpt_path=ckpt_path)

    TorchTrainer(
        train_loop_per_worker,
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(failure_config=ray.train.FailureConfig(max_failures=1)),
    ).fit()
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_rec._strategy.ray_worker import is_ray_environment
from lightning_rec._strategy.recshard import RecShardStrategy

__all__ = ["RayTrainReportCallback", "prepare_trainer", "restored_checkpoint"]

_INSTALL_HINT = 'HINT: install Ray Train with `pip install "lightning_rec[ray]"` (or `pip install "ray[train]"`).'


def _ray_train() -> Any:
    try:
        import ray.train
    except ImportError as err:
        raise ImportError(
            f"lightning_rec.integrations.ray needs Ray Train, which is not installed. {_INSTALL_HINT}"
        ) from err
    return ray.train


def _check_strategy(trainer: pl.Trainer, owner: str) -> RecShardStrategy:
    strategy = trainer.strategy
    if not isinstance(strategy, RecShardStrategy):
        raise ValueError(
            f"{owner}: the Trainer's strategy is {type(strategy).__name__}, not RecShardStrategy. HINT: build it "
            'with `L.Trainer(strategy="recshard", devices="auto", ...)`; for other strategies use '
            "ray.train.lightning's own helpers."
        )
    return strategy


def prepare_trainer(trainer: pl.Trainer) -> pl.Trainer:
    """Check that ``trainer`` runs recshard on Ray Train's ranks, and return it (what
    ``ray.train.lightning.prepare_trainer`` is for Ray's own strategies, which it requires).

    Args:
        trainer: a Trainer built inside ``train_loop_per_worker`` with ``strategy="recshard"`` (or a
            :class:`~lightning_rec.RecShardStrategy`).

    Returns:
        ``trainer``, unchanged.

    Raises:
        ValueError: the strategy is not recshard, or its cluster environment is not Ray's (called outside a Ray
            Train worker, or with another environment given).

    Example::

        trainer = prepare_trainer(L.Trainer(strategy="recshard", devices="auto"))
    """
    strategy = _check_strategy(trainer, "prepare_trainer")
    if not is_ray_environment(strategy.cluster_environment):
        hint = (
            _INSTALL_HINT
            if importlib.util.find_spec("ray") is None
            else "HINT: build the Trainer inside the train_loop_per_worker that ray.train.torch.TorchTrainer runs, "
            "and leave other cluster environments out of its plugins."
        )
        raise ValueError(
            "prepare_trainer: the Trainer's cluster environment is "
            f"{type(strategy.cluster_environment).__name__}, not Ray's RayLightningEnvironment. {hint}"
        )
    return trainer


@contextlib.contextmanager
def restored_checkpoint() -> Iterator[str | None]:
    """The ``ckpt_path`` of the checkpoint Ray Train restores this run from (``ray.train.get_checkpoint()``: the last
    one reported, after a failure or when the run resumes), or ``None`` on a first start.

    A checkpoint in local (or shared) storage is read where it is; one in remote storage is downloaded once per node
    into a temporary directory that lives as long as the ``with`` block (fit inside it).

    Yields:
        The checkpoint directory, as a string, or ``None``.

    Example::

        with restored_checkpoint() as ckpt_path:
            trainer.fit(model, datamodule, ckpt_path=ckpt_path)
    """
    checkpoint = _ray_train().get_checkpoint()
    if checkpoint is None:
        yield None
        return
    with checkpoint.as_directory() as directory:  # the same path on every worker: recshard reads rank 0's
        yield str(directory)


class RayTrainReportCallback(pl.Callback):
    """Saves recshard's sharded checkpoint directory and reports it to Ray Train, at the end of each training epoch
    or every ``every_n_train_steps`` steps (mid-epoch: the run resumes exactly there).

    Every rank writes its own shards (``trainer.save_checkpoint``); then every rank calls ``ray.train.report`` with
    the same metrics (``trainer.callback_metrics`` with ``epoch`` and ``step``), rank 0 with the checkpoint
    directory (``ray.train.Checkpoint.from_directory``), the others with none, as Ray's guide does when the workers
    share the directory: Ray copies it once into its storage (``RunConfig(storage_path=...)``; kept and pruned by
    ``CheckpointConfig``), and the local copy is deleted. Training goes on once Ray has committed the checkpoint, so
    a worker that dies after a report is restarted from that report. Restore with :func:`restored_checkpoint`.

    Use it with ``enable_checkpointing=False`` (Ray keeps the checkpoints) or beside a ``ModelCheckpoint``.

    Args:
        every_n_train_steps: report every this many optimizer steps; ``0`` (default): at the end of each training
            epoch, as Ray's ``RayTrainReportCallback`` does.
        dirpath: where each checkpoint is written before Ray copies it; every worker must see it (default: a folder
            in the system's temporary directory, named by Ray's job and experiment).

    Example::

        trainer = L.Trainer(strategy="recshard", devices="auto", enable_checkpointing=False,
                            callbacks=[RayTrainReportCallback(every_n_train_steps=100)])
    """

    def __init__(self, every_n_train_steps: int = 0, dirpath: str | os.PathLike[str] | None = None) -> None:
        if not isinstance(every_n_train_steps, int) or isinstance(every_n_train_steps, bool) or every_n_train_steps < 0:
            raise ValueError(
                f"RayTrainReportCallback: every_n_train_steps={every_n_train_steps!r}; expected an int >= 0 "
                "(0: at the end of each training epoch)."
            )
        self.every_n_train_steps = every_n_train_steps
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self._last_step = -1  # a step reported once, however many batches it took (gradient accumulation)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check the strategy and find Ray Train before the first step (not at the first report)."""
        _check_strategy(trainer, type(self).__name__)
        ray_train = _ray_train()
        if self.dirpath is None:
            context = ray_train.get_context()
            name = f"lightning_rec-ray-{context.get_experiment_name()}"
            self.dirpath = Path(tempfile.gettempdir(), name)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Report every ``every_n_train_steps`` steps."""
        step = trainer.global_step
        if self.every_n_train_steps and step % self.every_n_train_steps == 0 and step != self._last_step:
            self._report(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Report at the end of each training epoch (``every_n_train_steps=0``)."""
        if not self.every_n_train_steps and trainer.global_step != self._last_step:
            self._report(trainer)

    def _report(self, trainer: pl.Trainer) -> None:
        ray_train = _ray_train()
        assert self.dirpath is not None  # set in `setup`
        self._last_step = trainer.global_step
        path = self.dirpath / f"epoch={trainer.current_epoch}-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)  # every rank writes its shards into rank 0's path
        metrics: dict[str, Any] = {name: float(value) for name, value in trainer.callback_metrics.items()}
        metrics.update(epoch=trainer.current_epoch, step=trainer.global_step)
        checkpoint = ray_train.Checkpoint.from_directory(str(path)) if trainer.is_global_zero else None
        ray_train.report(metrics, checkpoint=checkpoint)  # a barrier: rank 0 returns once Ray holds its copy
        # Ray Train registers a report when its controller next polls the workers (every 2 s by default); a worker
        # that dies before then takes the report with it, and Ray restarts from the one before. Waiting until it is
        # committed makes "the last checkpoint reported" the one Ray restores.
        if hasattr(ray_train, "get_all_reported_checkpoints"):  # Ray Train v2 (RAY_TRAIN_V2_ENABLED: on in Ray 2.60)
            ray_train.get_all_reported_checkpoints(consistency_mode=ray_train.CheckpointConsistencyMode.COMMITTED)
        trainer.strategy.remove_checkpoint(path)  # rank 0
