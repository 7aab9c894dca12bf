"""The losses of retrieval models: the in-batch sampled softmax over every rank's candidates (logQ-corrected), and
Bayesian personalised ranking (BPR) with sampled negatives. Used by :class:`~lightning_rec.models.TwoTowerModule`.

**Exact on several ranks.** :func:`gather_candidates` gathers the candidate embeddings (and their item ids) of all
ranks with gradients (summed back to their rank in the backward pass), so each rank scores its queries against the
global batch's candidates; :func:`in_batch_softmax_loss` scales each rank's summed cross entropy so that the mean over
ranks (what DDP's gradient averaging and TorchRec's gradient division apply) is the whole batch's mean loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["bpr_loss", "gather_candidates", "in_batch_softmax_loss"]


class _GatherRows(torch.autograd.Function):
    """All ranks' ``(n, k)`` tensors (one size everywhere) stacked in rank order, ``(world * n, k)``; the gradient of
    this rank's rows is the sum of every rank's gradient of them (an all-reduce of the whole gradient, then this
    rank's slice: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, rows.contiguous())
        ctx.n = rows.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        start = dist.get_rank() * ctx.n
        return grad[start : start + ctx.n]


def gather_candidates(
    candidates: torch.Tensor, item_ids: torch.Tensor, log_q: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Every rank's candidate embeddings (with gradients), item ids and log sampling probabilities, in rank order.

    One collective carries all three (ids and ``log_q`` ride along as extra float64 columns: ids are exact below
    2**53), after a tiny one for the ranks' batch sizes, which may differ (padded for the collective, then cut).
    Without an initialised process group (or with one rank) the inputs come back unchanged.

    Returns:
        ``(global candidates (N, D), global item ids (N,), global log_q (N,) or None, offset of this rank's rows)``.

    Example::

        c_all, ids_all, _, offset = gather_candidates(c, batch_item_ids)
        labels = offset + torch.arange(c.shape[0])
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return candidates, item_ids, log_q, 0
    world, rank = dist.get_world_size(), dist.get_rank()
    local = torch.tensor([candidates.shape[0]], device=candidates.device, dtype=torch.long)
    sizes = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(sizes, local)
    counts = [int(s) for s in sizes]
    columns = [candidates.double(), item_ids.double().unsqueeze(1)]
    if log_q is not None:
        columns.append(log_q.double().unsqueeze(1))
    packed = torch.cat(columns, dim=1)
    packed = F.pad(packed, (0, 0, 0, max(counts) - packed.shape[0]))
    parts = _GatherRows.apply(packed).split(max(counts))  # backward: every rank's gradient of this rank's rows, summed
    gathered = torch.cat([part[:n] for part, n in zip(parts, counts)])
    width = candidates.shape[1]
    return (
        gathered[:, :width].to(candidates.dtype),
        gathered[:, width].long(),
        gathered[:, width + 1].to(log_q.dtype) if log_q is not None else None,
        sum(counts[:rank]),
    )


def in_batch_softmax_loss(
    queries: torch.Tensor,
    candidates: torch.Tensor,
    item_ids: torch.Tensor,
    temperature: float = 0.05,
    mask_duplicates: bool = True,
    log_q: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sampled-softmax loss with in-batch negatives, over the global batch on several ranks.

    Query ``i`` (of this rank) should score its own candidate above every other candidate of the global batch
    (:func:`gather_candidates`): ``logits[i, j] = q_i . c_j / temperature - log_q[j]``. ``log_q`` (optional) is each
    candidate's log probability of appearing in a batch; subtracting it is the sampling-bias ("logQ") correction of
    Yi et al. (RecSys 2019): popular items are in-batch negatives more often, and would otherwise be pushed down.
    ``mask_duplicates`` drops other columns holding query ``i``'s positive item (they are not negatives).

    The value is ``sum of this rank's cross entropies * world_size / global batch size``: its mean over ranks (what
    DDP and TorchRec's gradient division average) is the global batch's mean cross entropy; one process: the mean.

    Args:
        queries, candidates: ``(B, D)`` embeddings of this rank's pairs.
        item_ids: ``(B,)`` the candidates' item ids.
        temperature: the softmax temperature.
        mask_duplicates: mask in-batch repeats of the positive item.
        log_q: ``(B,)`` log sampling probabilities of the candidates, or ``None`` for no correction.

    Example::

        >>> q = F.normalize(torch.randn(4, 8), dim=1); c = F.normalize(torch.randn(4, 8), dim=1)
        >>> loss = in_batch_softmax_loss(q, c, torch.tensor([1, 2, 3, 4]), temperature=1.0)
        >>> bool(torch.isclose(loss, F.cross_entropy(q @ c.T, torch.arange(4))))
        True
    """
    if not temperature > 0:
        raise ValueError(f"in_batch_softmax_loss: temperature must be > 0, got {temperature}. HINT: e.g. 0.05.")
    all_c, all_ids, all_log_q, offset = gather_candidates(candidates, item_ids, log_q)
    logits = queries @ all_c.T / temperature
    if all_log_q is not None:
        logits = logits - all_log_q.unsqueeze(0)
    rows = torch.arange(queries.shape[0], device=queries.device)
    labels = offset + rows
    if mask_duplicates:
        same = item_ids.unsqueeze(1) == all_ids.unsqueeze(0)
        same[rows, labels] = False
        logits = logits.masked_fill(same, float("-inf"))
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return F.cross_entropy(logits, labels, reduction="sum") * (world / all_c.shape[0])


def bpr_loss(
    queries: torch.Tensor, positives: torch.Tensor, negatives: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Bayesian personalised ranking (Rendle et al., UAI 2009), RecBole's ``BPRLoss``: the mean of
    ``-log sigmoid((q . c_pos - q . c_neg) / temperature)`` over the rows (each row one sampled negative).

    Args:
        queries, positives, negatives: ``(B, D)`` embeddings of the queries, their positive and a negative item.
        temperature: divides the score difference (1 for raw dot products; small for L2-normalised towers, whose
            dot products lie in ``[-1, 1]``).

    Example::

        >>> q, p, n = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 1.0]])
        >>> round(bpr_loss(q, p, n).item(), 4)        # -log sigmoid(2 - 0)
        0.1269
    """
    difference = ((queries * positives).sum(1) - (queries * negatives).sum(1)) / temperature
    return F.softplus(-difference).mean()  # = -logsigmoid, without its underflow
