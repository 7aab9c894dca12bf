"""Lightning's private names recshard relies on: the process-group helpers, launchers and optimizer parsing its own
strategies share, where its loops stand, and the two places recshard changes (the "last" checkpoint route)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Lightning: what `move_data_to_device` moves (anything with a `.to`); the strategy moves batches itself so that
# TorchRec's batches and KJTs are copied without blocking (Lightning passes non_blocking to plain tensors only).
from lightning.fabric.utilities.apply_func import _TransferableDataType  # noqa: F401

# Lightning: what `configure_optimizers` may return (an optimizer, a list, a dict with a scheduler, ...) to the list of
# optimizers; `lightning-rec plan` calls `configure_optimizers` without a Trainer, so not through Lightning's hook.
from lightning.pytorch.core.optimizer import _configure_optimizers

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.loops.evaluation_loop import _EvaluationLoop
    from lightning.pytorch.loops.prediction_loop import _PredictionLoop
    from torch.optim import Optimizer


def parse_optimizers(optim_conf: Any) -> list:
    """The optimizers in what ``LightningModule.configure_optimizers`` returned (``None``: none)."""
    return [] if optim_conf is None else list(_configure_optimizers(optim_conf)[0])


def call_batch_hook(module: LightningModule, name: str, *args: object) -> object:
    """Run the LightningModule's (or the datamodule's) batch hook ``name`` the way Lightning does (its private
    ``_call_batch_hook``: the datamodule's override wins, with Lightning's profiling)."""
    return module._call_batch_hook(name, *args)


# Lightning: where its loops stand (the batch index in the training epoch, the validation loop fit runs, how many
# batches a loop has fetched). The loops' progress trackers are not a documented API; error messages use them to
# name the step and batch a failure happened at.
def training_batch_idx(trainer: Trainer) -> int:
    return trainer.fit_loop.epoch_loop.batch_idx


def fit_validation_loop(trainer: Trainer) -> _EvaluationLoop:
    return trainer.fit_loop.epoch_loop.val_loop


def batches_fetched(loop: _EvaluationLoop | _PredictionLoop) -> int:
    return loop.batch_progress.current.ready


# Lightning: LightningCLI keeps each subcommand's parser in a private dict, read through its private `_parser`;
# `lightning-rec predict --output` is an argument of that one subcommand (the others refuse it), added to its parser.
def subcommand_parser(cli: Any, subcommand: str) -> Any:
    """The parser of ``cli``'s ``subcommand`` (a ``LightningArgumentParser``), once ``setup_parser`` has run."""
    return cli._parser(subcommand)


# Lightning: a LightningModule's trainer, or None when it is not attached (the public `trainer` property raises then).
def attached_trainer(module: object) -> object | None:
    return getattr(module, "_trainer", None)


# Lightning: the optimizer inside a LightningOptimizer (or the optimizer itself).
def unwrap_optimizer(optimizer: Optimizer | LightningOptimizer) -> Optimizer:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


# Lightning: the handlers its signal connector puts back when a stage ends (``_SignalConnector._original_handlers``,
# taken when the stage starts and restored by ``teardown``). A preempted rank keeps its own handler past that point,
# so that a late signal (another copy of the one it stopped for) finds it rather than the default, which kills.
def restore_after_stage(trainer: Trainer, handlers: dict[int, Any]) -> None:
    """Make ``handlers`` (signal number -> handler) what ``trainer``'s stage leaves installed when it ends."""
    trainer._signal_connector._original_handlers.update(handlers)


# Lightning: the name of the next "hpc" checkpoint in a folder (``hpc_ckpt_<n+1>.ckpt``), the one its SLURM requeue
# resumes from; the preemption save uses the same name so that a requeued job finds it the way Lightning's own requeue
# does. Lightning's private ``_CheckpointConnector.hpc_save_path`` reads a number out of every name containing
# ``ckpt_`` (``int("")`` for ``hpc_ckpt_final.ckpt``: the save fails); here only ``hpc_ckpt_<digits>`` names count,
# staging leftovers included (their number is never reused).
def hpc_save_path(folder: Any) -> str:
    """Where Lightning's next "hpc" checkpoint in ``folder`` goes."""
    import os
    import re

    names = os.listdir(folder) if os.path.isdir(folder) else []
    numbers = [int(m.group(1)) for name in names if (m := re.search(r"hpc_ckpt_(\d+)", name))]
    return os.path.join(folder, f"hpc_ckpt_{max(numbers, default=0) + 1}.ckpt")


# Lightning: ``ckpt_path="last"`` is turned into a path by ``_CheckpointConnector._parse_ckpt_path`` in
# ``Trainer.fit/validate/...`` before any strategy hook runs; it looks only in the new run's own ``version_N`` folder
# (and nowhere for the "hpc" checkpoints a preempted job saves), and takes any run's checkpoint. With no ``ckpt_path``
# on SLURM it takes the highest-numbered name containing ``hpc_ckpt_`` (``_hpc_resume_path``), complete or not. A
# strategy with ``resolve_checkpoint(trainer, kind, quiet=False)`` answers both itself (kind ``"last"`` or
# ``"hpc"``; :mod:`lightning_rec._strategy.checkpoint_dirs`); the two are replaced once per process through the patch
# registry (class-level: there is no hook before them), and nothing changes for other strategies or other values.
def route_last_checkpoint() -> None:
    """Let the trainer's strategy resolve ``ckpt_path="last"`` and SLURM's requeue start (idempotent)."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from lightning_rec._compat.patches import patch_class_attribute

    def parse_ckpt_path(original: Any) -> Any:
        def _parse_ckpt_path(
            self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool
        ) -> Any:
            resolve = getattr(self.trainer.strategy, "resolve_checkpoint", None)
            if resolve is not None and ckpt_path == "last":
                return resolve(self.trainer, "last")  # None: start from scratch (said why)
            if resolve is not None and (ckpt_path == "hpc" or (ckpt_path is None and SLURMEnvironment.detect())):
                found = resolve(self.trainer, "hpc")
                if found is not None:
                    return found
            return original(self, state_fn, ckpt_path, model_provided, model_connected)

        return _parse_ckpt_path

    def hpc_resume_path(original: property) -> property:
        def _hpc_resume_path(self: Any) -> Any:
            resolve = getattr(self.trainer.strategy, "resolve_checkpoint", None)
            if resolve is None:
                return original.fget(self)  # type: ignore[misc]
            return resolve(self.trainer, "hpc", quiet=True)

        return property(_hpc_resume_path)

    patch_class_attribute("_CheckpointConnector._parse_ckpt_path", parse_ckpt_path)
    patch_class_attribute("_CheckpointConnector._hpc_resume_path", hpc_resume_path)


# Lightning: the training loader's state a fit resumed from a checkpoint is about to load (the FitLoop's private
# `_combined_loader_states_to_load`, set when the loops are restored). Lightning takes the loader's length before it
# loads that state, and an elastically resumed epoch's length is known only from the state: the DataModule loads it
# first (loading it again is a no-op), so Lightning counts the resumed epoch's steps right.
def pending_loader_state(trainer: Trainer | None) -> dict[str, Any] | None:
    """The state Lightning will load into the one training loader it is asking for, or ``None``."""
    loop = getattr(trainer, "fit_loop", None)
    states = getattr(loop, "_combined_loader_states_to_load", None)
    if loop is None or not loop.restarting or not isinstance(states, list) or len(states) != 1:
        return None
    return states[0] if isinstance(states[0], dict) else None
