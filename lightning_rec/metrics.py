"""Click/rating-prediction and ranking metrics as torchmetrics ``Metric``s, exact across ranks.

Log loss and normalized entropy keep sums (cross entropy, positives, count) as states reduced with
``"sum"``, so the value over N ranks is exactly the value over all their rows in one process. AUROC and
accuracy are torchmetrics' own (AUROC gathers every prediction; fine for validation sets, use
``BinaryAUROC(thresholds=...)`` for huge ones).

Inputs are probabilities in ``[0, 1]`` (apply ``sigmoid`` to logits) and targets in ``{0, 1}``.

Ranking metrics (retrieval, next-item prediction) take the 0-based rank of each held-out item among the
candidates (:func:`target_rank` computes it from scores) and keep per-``k`` sums, also reduced with ``"sum"``.
:class:`TopKMetrics` is RecBole's definition of recall, MRR, NDCG, hit and precision for several positives per
query, from a top-k hit matrix (:func:`topk_hits` builds it from scores, :func:`hits_from_ranks` from ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

__all__ = [
    "TOPK_METRICS",
    "LogLoss",
    "NormalizedEntropy",
    "RankingMetrics",
    "TopKMetrics",
    "ctr_metrics",
    "exclusion_mask",
    "hits_from_ranks",
    "target_rank",
    "topk_hits",
]

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


TopKMetricName = Literal["recall", "mrr", "ndcg", "hit", "precision"]
TOPK_METRICS: tuple[TopKMetricName, ...] = ("recall", "mrr", "ndcg", "hit", "precision")


def topk_hits(
    scores: torch.Tensor,
    positive_ids: torch.Tensor,
    positive_lengths: torch.Tensor,
    k: int,
    exclude_ids: torch.Tensor | None = None,
    exclude_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``k`` hit matrix and positive counts of a full ranking, as RecBole's evaluator builds them.

    RecBole's ``Trainer._full_sort_batch_eval`` sets the scores of excluded items (column 0 and the user's history)
    to ``-inf``; ``Collector.eval_batch_collect`` ("rec.topk") takes ``torch.topk(scores, k)`` and marks which of
    those ``k`` columns are positives, and counts each row's distinct positives. This function does the same, so
    ties between equal scores are broken as ``torch.topk`` breaks them (implementation-defined; with float
    embeddings exact ties are rare). Pass id 0 among ``exclude_ids`` when it is not an item (RecBole always excludes
    it; this function excludes only what it is given).

    Args:
        scores: ``(B, N)`` scores of the ``N`` candidates (column = item id).
        positive_ids: every row's positive item ids, concatenated (a row's repeats count once).
        positive_lengths: ``(B,)`` how many of ``positive_ids`` each row has.
        k: the list length (the largest cut-off of :class:`TopKMetrics`); above ``N`` the missing places are misses.
        exclude_ids, exclude_lengths: items each row does not rank (concatenated, and per-row counts), or ``None``.

    Returns:
        ``(hits, num_positives)``: ``(B, k)`` bool, ``hits[b, j]`` = the row's ``j``-th ranked item is a positive;
        ``(B,)`` long, each row's number of distinct positives. :meth:`TopKMetrics.update` takes both.

    Example::

        >>> scores = torch.tensor([[0.0, 0.9, 0.8, 0.7, 0.1], [0.0, 0.2, 0.9, 0.3, 0.4]])
        >>> hits, n = topk_hits(scores, torch.tensor([2, 4, 1]), torch.tensor([2, 1]), k=3,
        ...                     exclude_ids=torch.tensor([1]), exclude_lengths=torch.tensor([1, 0]))
        >>> hits.int().tolist(), n.tolist()          # row 0 ranks 2, 3, 4 (1 excluded); row 1 ranks 2, 4, 3
        ([[1, 0, 1], [0, 0, 0]], [2, 1])
    """
    if scores.dim() != 2 or positive_lengths.shape != scores.shape[:1]:
        raise ValueError(
            f"topk_hits: scores must be (B, N) and positive_lengths (B,), got {tuple(scores.shape)} and "
            f"{tuple(positive_lengths.shape)}."
        )
    if k < 1:
        raise ValueError(f"topk_hits: k must be >= 1, got {k}. HINT: the largest cut-off, e.g. 10.")
    b, n = scores.shape
    device = scores.device
    rows = torch.arange(b, device=device)
    positive = torch.zeros(b, n, dtype=torch.bool, device=device)
    positive[torch.repeat_interleave(rows, positive_lengths.to(device)), positive_ids.to(device)] = True
    if exclude_ids is not None and exclude_lengths is not None and exclude_ids.numel():
        scores = scores.clone()
        scores[torch.repeat_interleave(rows, exclude_lengths.to(device)), exclude_ids.to(device)] = float("-inf")
    _, top = torch.topk(scores, min(k, n), dim=1)
    hits = positive.gather(1, top)
    if k > n:
        hits = torch.cat([hits, hits.new_zeros(b, k - n)], dim=1)
    return hits, positive.sum(1)


def hits_from_ranks(
    ranks: torch.Tensor, k: int, lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``k`` hit matrix of queries given the 0-based ranks of their positives in the ranked list.

    A rank counts every item ahead, *including the query's other positives* (the positive at rank 3 of a query whose
    positives are ranked 0, 3 and 40 has two non-positives and one positive ahead of it).

    Args:
        ranks: the positives' ranks; with ``lengths=None`` one per query (``(B,)``, e.g. from :func:`target_rank`),
            else every query's ranks concatenated.
        k: the list length (the largest cut-off of :class:`TopKMetrics`).
        lengths: ``(B,)`` each query's number of positives, or ``None`` for one each.

    Returns:
        ``(hits (B, k) bool, num_positives (B,) long)`` for :meth:`TopKMetrics.update`.

    Example::

        >>> hits, n = hits_from_ranks(torch.tensor([0, 3, 40, 1]), k=4, lengths=torch.tensor([3, 1]))
        >>> hits.int().tolist(), n.tolist()
        ([[1, 0, 0, 1], [0, 1, 0, 0]], [3, 1])
    """
    ranks = ranks.reshape(-1).long()
    if lengths is None:
        lengths = torch.ones_like(ranks)
    if int(lengths.sum()) != ranks.numel():
        raise ValueError(f"hits_from_ranks: lengths sum to {int(lengths.sum())} but {ranks.numel()} ranks were given.")
    b = lengths.numel()
    rows = torch.repeat_interleave(torch.arange(b, device=ranks.device), lengths.to(ranks.device))
    hits = torch.zeros(b, k + 1, dtype=torch.bool, device=ranks.device)
    hits[rows, ranks.clamp(max=k)] = True  # column k collects every rank beyond the list, then is dropped
    return hits[:, :k], lengths.long()


class TopKMetrics(Metric):
    """RecBole's top-k metrics (``recbole/evaluator/metrics.py``) for queries with several positives each, exact
    across ranks.

    Per query with ``P`` positives and top-``K`` hit matrix row ``h`` (``h[j]``: the ``j``-th ranked item, 0-based, is
    a positive), each averaged over queries, as RecBole's ``TopkMetric.topk_result`` does:

    ======================  ===============================================================================
    ``recall@k``            ``sum(h[:k]) / P``                                      (RecBole ``Recall``)
    ``precision@k``         ``sum(h[:k]) / k``                                      (``Precision``)
    ``hit@k``               ``1 if any(h[:k]) else 0``                              (``Hit``)
    ``mrr@k``               ``1 / (f + 1)`` for the first hit ``f < k``, else 0     (``MRR``)
    ``ndcg@k``              ``sum_j h[j] / log2(j + 2)`` over ``j < k``, divided by the ideal
                            ``sum_i 1 / log2(i + 2)`` over ``i < min(P, k)``        (``NDCG``)
    ======================  ===============================================================================

    States are per-metric, per-``k`` sums and a query count reduced with ``"sum"``, so the value over N ranks equals
    the single-process one (up to float64 summation order). RecBole rounds its results to 4 decimals
    (``metric_decimal_place``); this class does not. A query without positives has no recall (RecBole never
    evaluates one): it is refused.

    Args:
        ks: the cut-offs, e.g. ``(10,)``; :meth:`update` needs hit matrices at least ``max(ks)`` wide.
        prefix: prepended to the keys, e.g. ``"test/"``: ``{prefix}recall@10``, ``{prefix}mrr@10``, ...
        metrics: which of ``recall``, ``mrr``, ``ndcg``, ``hit``, ``precision`` to report.
        kwargs: passed to ``torchmetrics.Metric``.

    Example::

        >>> m = TopKMetrics(ks=(2,), prefix="test/")
        >>> hits, n = hits_from_ranks(torch.tensor([1, 5, 0]), k=2, lengths=torch.tensor([2, 1]))
        >>> m.update(hits, n)          # query 0: positives at ranks 1 and 5; query 1: one positive at rank 0
        >>> {k: round(v.item(), 4) for k, v in m.compute().items()}
        {'test/recall@2': 0.75, 'test/mrr@2': 0.75, 'test/ndcg@2': 0.6934, 'test/hit@2': 1.0, 'test/precision@2': 0.5}
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    # states (add_state)
    sums: torch.Tensor
    count: torch.Tensor

    def __init__(
        self,
        ks: Sequence[int] = (10,),
        prefix: str = "",
        metrics: Sequence[TopKMetricName] = TOPK_METRICS,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        ks = [int(k) for k in ks]
        if not ks or min(ks) < 1 or len(set(ks)) != len(ks):
            raise ValueError(f"TopKMetrics: ks must be distinct integers >= 1, got {list(ks)}. HINT: e.g. ks=[10].")
        unknown = [m for m in metrics if m not in TOPK_METRICS]
        if unknown or not metrics or len(set(metrics)) != len(metrics):
            raise ValueError(
                f"TopKMetrics: metrics must be distinct names among {', '.join(TOPK_METRICS)}, got {list(metrics)}."
            )
        self.ks = ks
        self.prefix = prefix
        self.metrics = list(metrics)
        self.add_state("sums", torch.zeros(len(self.metrics), len(ks), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, hits: torch.Tensor, num_positives: torch.Tensor) -> None:
        """Add queries: ``hits`` ``(B, K)`` (``K >= max(ks)``; nonzero = positive at that place of the ranked list)
        and ``num_positives`` ``(B,)`` (each query's number of positives, in the list or not), e.g. from
        :func:`topk_hits` or :func:`hits_from_ranks`."""
        width = max(self.ks)
        if hits.dim() != 2 or hits.shape[1] < width or num_positives.shape != hits.shape[:1]:
            raise ValueError(
                f"TopKMetrics.update: hits must be (B, K) with K >= max(ks) = {width} and num_positives (B,), got "
                f"{tuple(hits.shape)} and {tuple(num_positives.shape)}."
            )
        if hits.shape[0] == 0:
            return
        h = hits[:, :width].to(self.sums.device).double()
        p = num_positives.to(self.sums.device).double()
        if bool((p < 1).any()) or bool((h.sum(1) > p).any()):
            raise ValueError(
                "TopKMetrics.update: every query needs at least one positive, and no more hits than positives. "
                "HINT: leave out queries with no positive in the split (RecBole does not evaluate them)."
            )
        place = torch.arange(width, device=h.device, dtype=torch.float64)
        discount = 1.0 / torch.log2(place + 2.0)
        found = h.cumsum(1)  # (B, K): positives among the first j + 1 places
        dcg = (h * discount).cumsum(1)
        ideal = discount.cumsum(0)  # ideal[i]: DCG of i + 1 positives on top
        first = h.argmax(1)  # the first hit's place (0 when there is none: masked below)
        reciprocal = h.gather(1, first.unsqueeze(1)).squeeze(1) / (first.double() + 1.0)
        per_k = []
        for k in self.ks:
            idx = k - 1
            value = {
                "recall": found[:, idx] / p,
                "precision": found[:, idx] / k,
                "hit": (found[:, idx] > 0).double(),
                "mrr": reciprocal * (first <= idx).double(),
                "ndcg": dcg[:, idx] / ideal[(p.long().clamp(max=k) - 1)],
            }
            per_k.append(torch.stack([value[m].sum() for m in self.metrics]))
        self.sums += torch.stack(per_k, dim=1)
        self.count += h.shape[0]

    def compute(self) -> dict:
        n = self.count.clamp(min=1.0)
        return {
            f"{self.prefix}{name}@{k}": self.sums[i, j] / n
            for j, k in enumerate(self.ks)
            for i, name in enumerate(self.metrics)
        }
