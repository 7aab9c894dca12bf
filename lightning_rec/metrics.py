"""Click/rating-prediction and ranking metrics as torchmetrics ``Metric``s, exact across ranks.

Log loss and normalized entropy keep sums (cross entropy, positives, count) as states reduced with
``"sum"``, so the value over N ranks is exactly the value over all their rows in one process. AUROC and
accuracy are torchmetrics' own (AUROC gathers every prediction; fine for validation sets, use
``BinaryAUROC(thresholds=...)`` for huge ones).

Inputs are probabilities in ``[0, 1]`` (apply ``sigmoid`` to logits) and targets in ``{0, 1}``.

Ranking metrics (retrieval, next-item prediction) take the 0-based rank of each held-out item among the
candidates (:func:`target_rank` computes it from scores) and keep per-``k`` sums, also reduced with ``"sum"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

__all__ = ["LogLoss", "NormalizedEntropy", "RankingMetrics", "ctr_metrics", "exclusion_mask", "target_rank"]

_EPS = 1e-12


def _check(preds: torch.Tensor, target: torch.Tensor, name: str) -> None:
    if preds.shape != target.shape:
        raise ValueError(f"{name}: preds {tuple(preds.shape)} and target {tuple(target.shape)} must have one shape.")
    if preds.numel() and not (preds.min() >= 0 and preds.max() <= 1):  # NaN fails too
        raise ValueError(
            f"{name}: preds must be probabilities in [0, 1], got values in [{preds.min().item():.4g},"
            f" {preds.max().item():.4g}]. HINT: pass torch.sigmoid(logits)."
        )


class LogLoss(Metric):
    """Mean binary cross entropy (natural log) of probabilities against 0/1 targets.

    Args:
        eps: predictions are clamped to ``[eps, 1 - eps]``, so a confident mistake costs ``-log(eps)``, not inf.
        validate_args: check that ``preds`` and ``target`` have one shape and ``preds`` lie in ``[0, 1]`` (a
            device-to-host sync per update; turn off in hot loops).
        kwargs: passed to ``torchmetrics.Metric`` (e.g. ``sync_on_compute``).

    Example::

        >>> m = LogLoss()
        >>> m.update(torch.tensor([0.9, 0.2]), torch.tensor([1, 0]))
        >>> round(m.compute().item(), 4)   # -(ln 0.9 + ln 0.8) / 2
        0.1643
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    # states (add_state)
    ce_sum: torch.Tensor
    count: torch.Tensor

    def __init__(self, eps: float = _EPS, validate_args: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.eps = eps
        self.validate_args = validate_args
        self.add_state("ce_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Add a batch: ``preds`` probabilities and ``target`` 0/1 labels of one shape."""
        if self.validate_args:
            _check(preds, target, type(self).__name__)
        p = preds.double().clamp(self.eps, 1 - self.eps)
        t = target.double()
        self.ce_sum += -(t * torch.log(p) + (1 - t) * torch.log1p(-p)).sum()
        self.count += t.numel()

    def compute(self) -> torch.Tensor:
        return self.ce_sum / self.count.clamp(min=1.0)


class NormalizedEntropy(LogLoss):
    """Normalized entropy (He et al., 2014): log loss divided by the entropy of the base rate.

    ``NE = logloss / -(p log p + (1 - p) log(1 - p))`` with ``p`` the mean target. Below 1 means better
    than always predicting the base rate; the same definition as ``torchrec.metrics.ne`` (the log base cancels).
    If every target is the same class the base entropy is about 0 and NE is huge, as in TorchRec.

    Args:
        eps: clamps predictions and the base rate to ``[eps, 1 - eps]``.
        validate_args: see :class:`LogLoss`.
        kwargs: passed to ``torchmetrics.Metric``.

    Example::

        >>> m = NormalizedEntropy()
        >>> m.update(torch.tensor([0.5, 0.5]), torch.tensor([1, 0]))   # predicting the base rate
        >>> round(m.compute().item(), 6)
        1.0
    """

    positives: torch.Tensor  # a state (add_state)

    def __init__(self, eps: float = _EPS, validate_args: bool = True, **kwargs: Any) -> None:
        super().__init__(eps=eps, validate_args=validate_args, **kwargs)
        self.add_state("positives", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Add a batch: ``preds`` probabilities and ``target`` 0/1 labels of one shape."""
        super().update(preds, target)
        self.positives += target.double().sum()

    def compute(self) -> torch.Tensor:
        p = (self.positives / self.count.clamp(min=1.0)).clamp(self.eps, 1 - self.eps)
        base_entropy = -(p * torch.log(p) + (1 - p) * torch.log1p(-p))
        return super().compute() / base_entropy


def ctr_metrics(prefix: str = "") -> MetricCollection:
    """AUROC, log loss, normalized entropy and accuracy (at 0.5) under ``prefix``.

    Example::

        >>> m = ctr_metrics("val/")
        >>> m.update(torch.tensor([0.9, 0.2, 0.6]), torch.tensor([1, 0, 0]))
        >>> sorted(m.compute())
        ['val/accuracy', 'val/auroc', 'val/log_loss', 'val/ne']
    """
    return MetricCollection(
        {"auroc": BinaryAUROC(), "log_loss": LogLoss(), "ne": NormalizedEntropy(), "accuracy": BinaryAccuracy()},
        prefix=prefix,
    )


def target_rank(scores: torch.Tensor, target: torch.Tensor, exclude: torch.Tensor | None = None) -> torch.Tensor:
    """The 0-based rank of each row's target column when the row is sorted by descending score.

    Ties are broken by column index (lower first), exactly as a stable descending sort would, so a constant
    score (e.g. equal popularities) never ranks the target optimistically. Excluded columns (e.g. the items a
    user already saw in training) are left out of the ranking; the target itself must not be excluded.

    Args:
        scores: ``(B, N)`` scores of ``N`` candidates.
        target: ``(B,)`` long column of each row's held-out item.
        exclude: optional ``(B, N)`` bool mask of columns that do not compete.

    Returns:
        ``(B,)`` long ranks in ``[0, N)``.

    Example::

        >>> target_rank(torch.tensor([[0.1, 0.9, 0.5, 0.5]]), torch.tensor([3])).tolist()   # 0.9 and the tied 0.5 first
        [2]
        >>> target_rank(torch.tensor([[0.1, 0.9, 0.5, 0.5]]), torch.tensor([3]),
        ...             exclude=torch.tensor([[False, True, False, False]])).tolist()
        [1]
    """
    if scores.dim() != 2 or target.shape != scores.shape[:1]:
        raise ValueError(
            f"target_rank: scores must be (B, N) and target (B,), got {tuple(scores.shape)} and {tuple(target.shape)}."
        )
    own = scores.gather(1, target.long().unsqueeze(1))
    columns = torch.arange(scores.shape[1], device=scores.device)
    ahead = (scores > own) | ((scores == own) & (columns < target.unsqueeze(1)))
    if exclude is not None:
        if bool(exclude.gather(1, target.long().unsqueeze(1)).any()):
            raise ValueError("target_rank: a row's target is excluded. HINT: exclude only items other than the target.")
        ahead &= ~exclude
    return ahead.sum(1)


def exclusion_mask(
    seen_values: torch.Tensor, seen_lengths: torch.Tensor, target: torch.Tensor, num_items: int
) -> torch.Tensor:
    """``(B, num_items)`` bool for :func:`target_rank`'s ``exclude``: the items each row does not rank (those it has
    seen, and id 0), never its target.

    Args:
        seen_values: the seen items of every row, concatenated.
        seen_lengths: ``(B,)`` how many of them each row has.
        target: ``(B,)`` each row's held-out item.
        num_items: the number of candidates (item ids ``0..num_items-1``).

    Example::

        >>> exclusion_mask(torch.tensor([2, 1, 3]), torch.tensor([2, 1]), torch.tensor([3, 1]), 4).int().tolist()
        [[1, 1, 1, 0], [1, 0, 0, 1]]
    """
    b = seen_lengths.numel()
    mask = torch.zeros(b, num_items, dtype=torch.bool, device=target.device)
    rows = torch.repeat_interleave(torch.arange(b, device=target.device), seen_lengths.to(target.device))
    mask[rows, seen_values.to(target.device)] = True
    mask[:, 0] = True
    mask[torch.arange(b, device=target.device), target] = False
    return mask


class RankingMetrics(Metric):
    """Hit rate (= recall with one held-out item) and NDCG at several cut-offs, from the held-out item's rank.

    With one relevant item per query, ``recall@k = HR@k = [rank < k]`` and ``NDCG@k = [rank < k] / log2(rank + 2)``,
    averaged over queries. States are per-``k`` sums and a count reduced with ``"sum"``, so the value over N ranks
    equals the single-process one (hits exactly; NDCG up to float64 summation order).

    Args:
        ks: the cut-offs, e.g. ``(10, 50)``.
        prefix: prepended to the keys of :meth:`compute`, e.g. ``"val/"``.
        hit_name: the name of the hit metric (``"recall"`` for retrieval, ``"hr"`` for next-item prediction).
        kwargs: passed to ``torchmetrics.Metric``.

    Example::

        >>> m = RankingMetrics(ks=(1, 10), prefix="val/")
        >>> m.update(torch.tensor([0, 3, 20]))                 # 0-based ranks of three held-out items
        >>> {k: round(v.item(), 4) for k, v in m.compute().items()}
        {'val/recall@1': 0.3333, 'val/ndcg@1': 0.3333, 'val/recall@10': 0.6667, 'val/ndcg@10': 0.4769}
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    # states (add_state)
    hits: torch.Tensor
    ndcg: torch.Tensor
    count: torch.Tensor

    def __init__(self, ks: Sequence[int] = (10,), prefix: str = "", hit_name: str = "recall", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        ks = [int(k) for k in ks]
        if not ks or min(ks) < 1 or len(set(ks)) != len(ks):
            raise ValueError(
                f"RankingMetrics: ks must be distinct integers >= 1, got {list(ks)}. HINT: e.g. ks=[10, 50]."
            )
        self.ks = ks
        self.prefix = prefix
        self.hit_name = hit_name
        self.add_state("hits", torch.zeros(len(ks), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("ndcg", torch.zeros(len(ks), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, rank: torch.Tensor) -> None:
        """Add queries: ``rank`` holds each held-out item's 0-based rank (see :func:`target_rank`)."""
        rank = rank.reshape(-1).to(self.hits.device)
        k = torch.tensor(self.ks, device=rank.device, dtype=rank.dtype)
        hit = rank.unsqueeze(0) < k.unsqueeze(1)  # (len(ks), B)
        gain = 1.0 / torch.log2(rank.double() + 2.0)
        self.hits += hit.double().sum(1)
        self.ndcg += (hit.double() * gain.unsqueeze(0)).sum(1)
        self.count += rank.numel()

    def compute(self) -> dict:
        n = self.count.clamp(min=1.0)
        out = {}
        for i, k in enumerate(self.ks):
            out[f"{self.prefix}{self.hit_name}@{k}"] = self.hits[i] / n
            out[f"{self.prefix}ndcg@{k}"] = self.ndcg[i] / n
        return out
