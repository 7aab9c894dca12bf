"""TorchRec's log lines and warnings that do not apply to a recshard run, silenced where recshard causes them.

Each is named with why it does not apply; anything else TorchRec says still reaches the user.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

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
