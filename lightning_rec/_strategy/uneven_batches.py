"""Batches of different sizes on each rank, with every sharding type, over gloo.

TorchRec's row-wise, table-row-wise and grid shardings sum each sample's pooled embedding over the ranks holding its
rows with a reduce-scatter split by the ranks' batch sizes. When the sizes differ (a data set with an odd row count
ends its epoch with one row more on one rank), TorchRec takes its "v" path, whose backward all-gathers the gradient's
unequal pieces with ``dist.all_gather``: NCCL takes them, gloo refuses (``ProcessGroupGloo::allgather: invalid tensor
size``; TorchRec's ``PooledEmbeddingsReduceScatter`` says its reduce-scatter-v "is only available for NCCL backend").
Table-wise, column-wise and data-parallel tables, and sequence (``EmbeddingCollection``) tables of every sharding
type, already train on such batches: their collectives are all-to-alls and all-reduces.

:func:`allow_uneven_batches_over_gloo` fills the gap: over gloo, that all-gather runs on pieces padded with zeros to
the largest (:func:`padded_all_gather`: gloo's equal all-gather) and each piece is cut back to its rows. The pieces are
the same numbers NCCL's unequal all-gather delivers, so gradients and every update are TorchRec's; batches of equal
sizes, and NCCL, run TorchRec's own code.

Example::

    allow_uneven_batches_over_gloo()   # once per process, before the first backward (recshard's setup does it)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_rec import _compat

__all__ = ["allow_uneven_batches_over_gloo", "padded_all_gather"]

_PATCHED = "ReduceScatterV_Wait.backward"


class _PaddedGather:
    """The pending all-gather of :func:`padded_all_gather`: ``wait()`` waits for it, then copies each rank's rows into
    its piece (the contract of the work object ``dist.all_gather(..., async_op=True)`` returns)."""

    def __init__(self, work: dist.Work, gathered: torch.Tensor, pieces: Sequence[torch.Tensor]) -> None:
        self._work, self._gathered, self._pieces = work, gathered, pieces

    def wait(self) -> bool:
        self._work.wait()
        for piece, padded in zip(self._pieces, self._gathered.chunk(len(self._pieces))):
            piece.copy_(padded[: piece.shape[0]])
        return True


def padded_all_gather(
    pieces: Sequence[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> _PaddedGather:
    """``dist.all_gather(pieces, tensor, group, async_op=True)`` for pieces of different lengths (dim 0), on any
    backend: every rank's tensor padded with zeros to the longest, gathered in equal sizes, cut back on ``wait()``.

    Args:
        pieces: one tensor per rank of ``group``, each shaped as that rank's ``tensor``; filled on ``wait()``.
        tensor: this rank's piece.
        group: the process group (default: the default group).

    Example::

        pieces = [torch.empty(n, 8) for n in (5, 4)]          # rank 0 sends 5 rows, rank 1 sends 4
        padded_all_gather(pieces, my_rows).wait()
    """
    longest = max(piece.shape[0] for piece in pieces)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    gathered = tensor.new_empty((len(pieces) * longest, *tensor.shape[1:]))  # rank r's rows at r * longest
    work = dist.all_gather_into_tensor(gathered, padded, group=group, async_op=True)
    assert work is not None  # async_op=True always returns the work
    return _PaddedGather(work, gathered, pieces)


def _over_gloo(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO


def allow_uneven_batches_over_gloo() -> None:
    """Let TorchRec's row-wise, table-row-wise and grid shardings train batches of different sizes on each gloo rank
    (see the module docstring). For the whole process, once (later calls do nothing); NCCL and equal batches run
    TorchRec's own code. recshard calls it when it sets up a process group.
    """
    _compat.patch_class_attribute(
        _PATCHED, lambda original: _compat.reduce_scatter_v_backward(original, padded_all_gather, _over_gloo)
    )
