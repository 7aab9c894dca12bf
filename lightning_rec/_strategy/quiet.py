"""TorchRec's log lines and warnings that do not apply to a recshard run, silenced where recshard causes them.

Each is named with why it does not apply; anything else TorchRec says still reaches the user. Also: Lightning's
default progress bar prints each bar's first line once, not twice (:func:`print_bar_lines_once`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from lightning_rec import _compat

# logger name -> messages (their start or a part) dropped while recshard plans and shards.
_LOGGED: dict[str, tuple[str, ...]] = {
    # TorchRec's planner (planners.py) validates the plan and logs this for every data-parallel table: such a table has
    # no sharding spec by design (it is replicated), so every plan with one prints it.
    "root": ("Sharding spec not found for ",),
    # TorchRec (distributed/utils.py) logs this once per data-parallel table whether or not any caching parameter was
    # given; recshard gives none.
    "torchrec.distributed.utils": ("caching params will be ignored",),
}
# TorchRec's own DDP wrappers (DMP's dense part, data-parallel lookups) pass `broadcast_buffers`, which torch now
# deprecates; nothing the user can change.
_WARNED: tuple[tuple[type, str], ...] = ((FutureWarning, r"`broadcast_buffers` is deprecated"),)


class _Drop(logging.Filter):
    def __init__(self, parts: tuple[str, ...]) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


@contextlib.contextmanager
def torchrec_noise_silenced() -> Iterator[None]:
    """Within this block, the TorchRec messages above are dropped (and only those).

    Example::

        >>> import logging
        >>> with torchrec_noise_silenced():
        ...     logging.warning("Sharding spec not found for ebc.t_user")   # dropped
    """
    filters = [(logging.getLogger(None if name == "root" else name), _Drop(parts)) for name, parts in _LOGGED.items()]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            for category, message in _WARNED:
                warnings.filterwarnings("ignore", message=message, category=category)
            yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


# The environment variable that keeps every warning and log line below (`=1`): the filters' opt-out.
ALL_WARNINGS = "LIGHTNING_REC_ALL_WARNINGS"
# Warnings a recshard run raises on every step or checkpoint that this project has shown to be harmless, with why
# (README "What you will not see"). Matched by their text: anything else, of any category, still reaches the user.
PROVEN_HARMLESS: tuple[tuple[str, str], ...] = (
    (
        r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered",
        "FBGEMM's lookup of data-parallel tables runs its backward through a Python autograd.Function, not the "
        "operator's own kernel; the exactness tests (tests/strategy) compare every sharding type, data-parallel "
        "included, with unsharded training to 1e-5.",
    ),
    (
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        "TorchRec keeps sharded tables as ShardedTensors, and torch's distributed checkpoint says so on every save "
        "and load; nothing a user can change (tests/checkpoint round-trips them exactly).",
    ),
    (
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        "TorchRec's row-wise sharding (and table-row-wise, grid) runs its collectives through these names (comm_ops); "
        "torch deprecates the names, not what they do, and says so (FutureWarning) on every run with such a table, "
        "the quickstart's included; nothing a user can change (tests/strategy compare row-wise training with "
        "unsharded training).",
    ),
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "Lightning's own code (utilities/_pytree.py) calls torch's deprecated pytree API; nothing a user can change.",
    ),
)
# Logged, not warned: torch's fx says this once per process when TorchRec's KeyedJaggedTensor asks whether it is
# being traced; a recshard step is never traced. Lightning's seed_everything, which Lightning's launcher runs again in
# every other rank (it re-runs the script), logs the same seed there with a "[rank: N] " prefix: rank 0's line says it.
_LOGGED_HARMLESS = {
    "torch.fx._symbolic_trace": ("is_fx_tracing will return true",),
    "lightning.fabric.utilities.seed": ("] Seed set to ",),
}


def silence_proven_harmless() -> None:
    """Drop the warnings and log lines in :data:`PROVEN_HARMLESS` for the rest of the process (idempotent); importing
    the package and the strategy in each rank's process call it. The opt-out: ``LIGHTNING_REC_ALL_WARNINGS=1`` in the
    environment keeps every one of them.

    Example::

        >>> silence_proven_harmless()
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("default")
        ...     silence_proven_harmless()
        ...     warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
        >>> caught
        []
    """
    if os.environ.get(ALL_WARNINGS) == "1":
        return
    for message, _ in PROVEN_HARMLESS:
        warnings.filterwarnings("ignore", message=message)
    for name, parts in _LOGGED_HARMLESS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.parts == parts for f in logger.filters):
            logger.addFilter(_Drop(parts))


# The bars of Lightning's TQDMProgressBar that print their first line twice: created ("Training: 0/?"), then reset to
# the epoch's (or the validation loader's) total before their description changes (the same line again).
_BAR_FACTORIES = ("init_train_tqdm", "init_validation_tqdm")


def print_bar_lines_once(trainer: Any) -> None:
    """Make the trainer's progress bar, if it is Lightning's ``TQDMProgressBar`` with its own bar factories, print
    each bar's first line once: the first reset of a bar it creates is silent (the next line, with the epoch or the
    loader's name, follows at once). Idempotent; a bar of the user's own making is left as it is.

    Example::

        print_bar_lines_once(trainer)   # the strategy's setup does it
    """
    from lightning.pytorch.callbacks import TQDMProgressBar

    bar = trainer.progress_bar_callback
    if not isinstance(bar, TQDMProgressBar):
        return
    for name in _BAR_FACTORIES:
        if getattr(type(bar), name) is not getattr(TQDMProgressBar, name) or _compat.is_patched(bar, name):
            continue  # a subclass's own bars, or done already
        _compat.patch_method(bar, name, _first_reset_silent(_compat.original_method(bar, name)))


def _first_reset_silent(factory: Callable[[], Any]) -> Callable[[], Any]:
    def create() -> Any:
        tqdm_bar = factory()
        reset = _compat.original_method(tqdm_bar, "reset")

        def silent_reset(total: Any = None) -> None:
            _compat.unpatch_method(tqdm_bar, "reset")  # later resets print as tqdm's do
            disabled, tqdm_bar.disable = tqdm_bar.disable, True  # tqdm's reset prints nothing for a disabled bar
            try:
                reset(total)
            finally:
                tqdm_bar.disable = disabled

        _compat.patch_method(tqdm_bar, "reset", silent_reset)
        return tqdm_bar

    return create
