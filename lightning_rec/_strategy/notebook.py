"""Training on several CPU processes from a notebook: the ranks are forked from the notebook's kernel, as Lightning's
``ddp_notebook`` does (a notebook cannot be re-run as a script, so the script launcher is refused there), and the
trained weights come back into the notebook's module, tables included, unsharded."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from lightning_rec import _compat

__all__ = ["NotebookLauncher"]


class NotebookLauncher(_compat._MultiProcessingLauncher):
    """Lightning's fork launcher, with the weights of a sharded module brought back whole.

    Lightning's launcher hands rank 0's ``state_dict()`` to the notebook's process; a sharded module's tables are
    ShardedTensors there (rank 0's shards only), and the notebook's copy of the module still has its tables on
    ``meta``. Instead every rank writes a sharded checkpoint (collectively) into a temporary folder, and the
    notebook's process reads it unsharded (:mod:`lightning_rec.checkpoint`) into its module, then removes it.

    Example::

        trainer = L.Trainer(strategy="recshard", accelerator="cpu", devices=2)   # in Jupyter: forks 2 ranks
        trainer.fit(model, loader)
        model.ebc.embedding_bags["t_user"].weight    # the trained rows, in the notebook
    """

    def __init__(self, strategy: pl.strategies.ParallelStrategy) -> None:
        super().__init__(strategy, start_method="fork")

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        folder = None
        if trainer.state.fn == TrainerFn.FITTING:
            made = tempfile.mkdtemp(prefix="lightning_rec_notebook_") if self._strategy.global_rank == 0 else None
            folder = self._strategy.broadcast(made)
            assert folder is not None
            trainer.save_checkpoint(Path(folder) / "trained.ckpt")  # every rank: its shards
        if self._strategy.local_rank != 0:
            return None
        best = getattr(trainer.checkpoint_callback, "best_model_path", None)
        return _compat._WorkerOutput(best, folder, trainer.state, results, self.get_extra_results(trainer))

    def _recover_results_in_main_process(self, worker_output: Any, trainer: pl.Trainer) -> None:
        folder = worker_output.weights_path
        if folder is not None:
            from lightning_rec.checkpoint._export import _assemble, with_pinned

            try:
                state = with_pinned(Path(folder) / "trained.ckpt", lambda pinned: _assemble(pinned, "", False))
                trainer.lightning_module.load_state_dict(state, strict=False, assign=True)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        super()._recover_results_in_main_process(worker_output._replace(weights_path=None), trainer)
