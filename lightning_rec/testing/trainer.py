"""The ``Trainer`` arguments of a measured or compared run: nothing written, nothing drawn, batches as given."""

from __future__ import annotations

from typing import Any

__all__ = ["QUIET_TRAINER"]

#: No logger, checkpoints, progress bar or model summary (nothing written where a run did not ask), no sanity
#: validation, and the loader's batches left as they are (no sampler injected: each rank's batches are its own).
#:
#: Example::
#:
#:     trainer = L.Trainer(strategy=RecShardStrategy(), devices=2, max_steps=5, **QUIET_TRAINER)
QUIET_TRAINER: dict[str, Any] = dict(
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    use_distributed_sampler=False,
    num_sanity_val_steps=0,
)
