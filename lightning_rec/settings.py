"""Checks of a run's settings that the strategy makes before any state changes, with errors saying what to do."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["check_precision", "check_trainer_flags"]


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
    """Refuse gradient accumulation with tables; warn that clipping reaches dense gradients only."""
    if trainer.accumulate_grad_batches != 1 and has_tables:
        raise ValueError(
            f"{owner} does not support accumulate_grad_batches={trainer.accumulate_grad_batches}: "
            "embedding rows are updated inside every backward pass (FBGEMM fused optimizers), so their "
            "gradients cannot be accumulated. HINT: increase the batch size instead."
        )
    if trainer.gradient_clip_val:
        rank_zero_warn(
            f"{owner}: gradient_clip_val applies to the dense parameters only; embedding "
            "gradients are consumed inside the backward pass by the fused optimizer and never materialised."
        )
