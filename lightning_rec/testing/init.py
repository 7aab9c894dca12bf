"""Deterministic starting weights: a value per (tensor name, global index), whatever the plan, world size or RNG.

Runs that shard the same model differently (or not at all) start from the same weights, so their losses and
final weights can be compared exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["deterministic_init", "pattern"]


def pattern(
    name: str,
    shape: Sequence[int],
    offsets: Sequence[int],
    *,
    scale: float = 0.1,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The deterministic values of one block of a tensor: they depend on the name and the global index only.

    Element ``(i, j)`` of the tensor called ``name`` is ``scale * sin(0.37 i + 0.11 j + phase)`` (``0.37 i`` for
    1-D tensors), with ``phase = sum(map(ord, name)) % 97``, computed in float64 and returned as float32.

    Args:
        name: the name whose characters set the phase.
        shape: the block's shape (1-D or 2-D).
        offsets: the block's global offsets (a shard's ``shard_offsets``; zeros for a whole tensor).
        scale: the amplitude.
        device: where to compute (default: the CPU).

    Returns:
        A float32 tensor of ``shape``.

    Example::

        >>> from lightning_rec.testing.init import pattern
        >>> whole = pattern("w", (4, 3), (0, 0))
        >>> torch.equal(pattern("w", (2, 3), (2, 0)), whole[2:])  # a shard holds its slice of the whole
        True
    """
    phase = sum(map(ord, name)) % 97
    idx = [torch.arange(o, o + s, dtype=torch.float64, device=device) for o, s in zip(offsets, shape)]
    grid = idx[0] * 0.37 if len(idx) == 1 else idx[0][:, None] * 0.37 + idx[1][None, :] * 0.11
    return (scale * torch.sin(grid + phase)).float()


@torch.no_grad()
def deterministic_init(
    module: nn.Module,
    *,
    scale: float = 0.1,
    phase_name: Callable[[str], str] | None = None,
    block_rows: int | None = None,
) -> None:
    """Overwrite every floating-point entry of ``module.state_dict()`` (sharded or not) with :func:`pattern`.

    A sharded table (a ``ShardedTensor``) gets its local shards filled at their global offsets, so every plan and
    world size starts from the same global weights.

    Args:
        module: the model (unsharded, or wrapped by ``DistributedModelParallel``).
        scale: the amplitude of :func:`pattern`.
        phase_name: maps a state-dict name to the name that sets the phase (default: the name itself), so that
            models whose names differ only by a prefix can start from the same weights.
        block_rows: if given, fill ``block_rows`` rows at a time, computed on the tensor's own device (bounded
            float64 temporaries for large tables); by default each tensor is computed whole, on the CPU.

    Example::

        >>> from lightning_rec.testing.init import deterministic_init
        >>> a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
        >>> deterministic_init(a); deterministic_init(b)
        >>> torch.equal(a.weight, b.weight)
        True
    """
    from lightning_rec import _compat

    def fill(out: torch.Tensor, name: str, offsets: Sequence[int]) -> None:
        phase = phase_name(name) if phase_name is not None else name
        if block_rows is None:
            out.copy_(pattern(phase, out.shape, offsets, scale=scale))
            return
        for start in range(0, out.shape[0], block_rows):
            rows = out[start : start + block_rows]
            rows.copy_(pattern(phase, rows.shape, [offsets[0] + start, *offsets[1:]], scale=scale, device=out.device))

    for name, t in module.state_dict().items():
        if isinstance(t, _compat.ShardedTensor):
            for shard in t.local_shards():
                fill(shard.tensor, name, list(shard.metadata.shard_offsets))
        elif t.is_floating_point():
            fill(t, name, [0] * t.dim())
