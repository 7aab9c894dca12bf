"""Checks of a run's settings that the strategy makes before any state changes, with errors saying what to do."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelPruning, StochasticWeightAveraging
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_rec._tables import embedding_modules, is_sharded

try:  # Lightning >= 2.6 (EMA and SWA as one callback); older versions do not have it
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # pragma: no cover - lightning 2.5
    WeightAveraging = ()  # type: ignore[assignment,misc]  # isinstance(x, ()) is always False

__all__ = [
    "check_frozen_tables",
    "check_precision",
    "check_trainer_flags",
    "raised_in",
    "toggle_optimizer_error",
]


def check_precision(precision: str, owner: str = "RecShardStrategy") -> None:
    """Refuse precisions the fused embedding optimizers cannot honour.

    Example::

        >>> check_precision("bf16-mixed")
        >>> check_precision("16-mixed")
        Traceback (most recent call last):
        ...
        ValueError: RecShardStrategy does not support precision='16-mixed': ...
    """
    if precision in ("32-true", "32", "bf16-mixed"):
        return
    if precision == "16-mixed":
        raise ValueError(
            f"{owner} does not support precision='16-mixed': its gradient scaler skips steps "
            "whose gradients overflow, but embedding rows are already updated inside the backward pass, so "
            "skipped steps would silently half-apply. HINT: use precision='bf16-mixed' (no loss scaling) "
            "or '32-true'."
        )
    raise ValueError(
        f"{owner} supports precision='32-true' and 'bf16-mixed', got {precision!r}. "
        "HINT: for lower-precision tables set `fused_params={'weights_precision': ...}` instead of "
        "converting the whole module."
    )


def check_trainer_flags(trainer: Any, has_tables: bool, owner: str = "RecShardStrategy") -> None:
    """Refuse what cannot work with fused tables (gradient accumulation, weight averaging, pruning callbacks); warn
    that clipping reaches dense gradients only. Called before anything is sharded or trained."""
    if trainer.accumulate_grad_batches != 1 and has_tables:
        raise ValueError(
            f"{owner} does not support accumulate_grad_batches={trainer.accumulate_grad_batches}: "
            "embedding rows are updated inside every backward pass (FBGEMM fused optimizers), so their "
            "gradients cannot be accumulated. HINT: increase the batch size instead."
        )
    if has_tables:
        for callback in trainer.callbacks:
            if isinstance(callback, (StochasticWeightAveraging, WeightAveraging)):
                raise ValueError(
                    f"{owner} does not support the {type(callback).__name__} callback: it averages `parameters()` "
                    "of a copy of the module taken before the tables were sharded with those of the sharded module, "
                    "whose table parameters are other tensors (the local shards, updated inside the backward pass), "
                    f"so the tables would be averaged with the wrong tensors or not at all. HINT: remove "
                    f"{type(callback).__name__}, or average checkpoints offline (`load_from_checkpoint` gives whole "
                    "tables)."
                )
            if isinstance(callback, GradientAccumulationScheduler) and callback.going_to_accumulate_grad_batches():
                raise ValueError(
                    f"{owner} does not support GradientAccumulationScheduler(scheduling={callback.scheduling}): "
                    "embedding rows are updated inside every backward pass (FBGEMM fused optimizers), so their "
                    "gradients cannot be accumulated. HINT: increase the batch size instead."
                )
            if isinstance(callback, ModelPruning):
                raise ValueError(
                    f"{owner} does not support the ModelPruning callback: it collects the modules to prune before "
                    "the tables are sharded, so it would prune embedding modules that sharding replaces (the "
                    "trained tables stay unpruned) while keeping the unsharded tables alive. HINT: prune the dense "
                    "layers yourself with `torch.nn.utils.prune` (e.g. in `on_train_epoch_end`)."
                )
    if trainer.gradient_clip_val:
        rank_zero_warn(
            f"{owner}: gradient_clip_val applies to the dense parameters only; embedding "
            "gradients are consumed inside the backward pass by the fused optimizer and never materialised."
        )


def check_fit(trainer: Any, module: nn.Module, module_types: Sequence[type], owner: str = "RecShardStrategy") -> bool:
    """Before fitting: :func:`check_trainer_flags`, and :func:`check_frozen_tables` unless the tables are sharded
    already (a second ``fit``). Returns whether ``module`` has tables (then every backward must be followed by an
    optimizer step: see :func:`~lightning_rec._strategy.hook_state.backward_without_step_error`)."""
    tables, sharded = embedding_modules(module, module_types), is_sharded(module)
    has_tables = bool(tables) or sharded
    check_trainer_flags(trainer, has_tables, owner)
    if not sharded:  # frozen tables would train anyway (fused update in backward)
        check_frozen_tables(((f"{path}.{n}", p) for path, m in tables.items() for n, p in m.named_parameters()), owner)
    return has_tables


def check_frozen_tables(named_tables: Iterable[tuple[str, nn.Parameter]], owner: str = "RecShardStrategy") -> None:
    """Refuse table parameters with ``requires_grad=False`` (frozen by hand or by a finetuning callback such as
    ``BackboneFinetuning``): a fused kernel updates every row its backward pass reaches, frozen or not."""
    frozen = [name for name, p in named_tables if not p.requires_grad]
    if frozen:
        raise ValueError(
            f"{owner}: {', '.join(repr(n) for n in frozen)} {'has' if len(frozen) == 1 else 'have'} "
            "requires_grad=False, but the FBGEMM fused optimizer updates table rows inside the backward pass "
            "whatever requires_grad says, so a frozen table would silently train. HINT: to keep the tables fixed, leave "
            "requires_grad=True and declare `configure_embedding_optimizer()` returning "
            "`EmbeddingOptimizer('sgd', lr=0.0)` (or the strategy's `embedding_optimizer=`); freeze only dense layers "
            "(e.g. BackboneFinetuning on a dense backbone)."
        )


def toggle_optimizer_error(owner: str = "RecShardStrategy") -> RuntimeError:
    """The error for ``LightningModule.toggle_optimizer`` with fused tables (torch's own is about ShardedTensor)."""
    return RuntimeError(
        f"{owner} does not support `toggle_optimizer`: it sets requires_grad=False on the other optimizers' "
        "parameters so that a backward pass leaves them alone, but the embedding tables are updated by the FBGEMM "
        "fused optimizer inside every backward pass that reaches them, whatever requires_grad says (and torch "
        "refuses requires_grad on their sharded tensors). HINT: keep the tables out of a loss whose backward must "
        "not train them (e.g. `.detach()` the pooled embeddings there) instead of toggling optimizers."
    )


def raised_in(error: BaseException, function: str) -> bool:
    """Whether ``error`` was raised inside a call of a function named ``function`` (by its traceback)."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False
