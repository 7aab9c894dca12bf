"""The planner's numbers, each named once: what ``fit`` plans with and what ``lightning-rec plan`` explains with.

Example::

    >>> int(40 * GIB * (1 - STORAGE_RESERVATION)) // GIB   # what the planner packs onto a 40 GiB rank
    34
"""

from __future__ import annotations

from torchrec.distributed.planner.constants import BATCH_SIZE

__all__ = [
    "CANDIDATE_SCALES",
    "DEFAULT_BATCH_SIZE",
    "GIB",
    "LARGEST_TABLES_NAMED",
    "MAX_CANDIDATE_PLANS",
    "MIB",
    "STORAGE_RESERVATION",
]

GIB = 1024**3
MIB = 1024**2

# The share of each rank's memory the planner keeps back (for the dense layers, the batches, the kernels' buffers):
# TorchRec's recommended FixedPercentageStorageReservation (its heuristic default warns that it over-estimates the
# dense size). The does-not-fit explanation counts the same share as unusable.
STORAGE_RESERVATION = 0.15

# The per-rank batch size of the planner's cost model when neither the run nor TopologyConfig says: TorchRec's.
DEFAULT_BATCH_SIZE: int = BATCH_SIZE

# A model that does not fit: the bigger topologies tried (this many times the hosts), the most of them planned (each
# one a full planner run), and how many of the largest tables the explanation names.
CANDIDATE_SCALES = (2, 4, 8, 16, 32, 64)
MAX_CANDIDATE_PLANS = 4
LARGEST_TABLES_NAMED = 5
