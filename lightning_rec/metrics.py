"""Click/rating-prediction metrics as torchmetrics ``Metric``s, exact across ranks.

Log loss and normalized entropy keep sums (cross entropy, positives, count) as states reduced with
``"sum"``, so the value over N ranks is exactly the value over all their rows in one process. AUROC and
accuracy are torchmetrics' own (AUROC gathers every prediction; fine for validation sets, use
``BinaryAUROC(thresholds=...)`` for huge ones).

Inputs are probabilities in ``[0, 1]`` (apply ``sigmoid`` to logits) and targets in ``{0, 1}``.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

__all__ = ["LogLoss", "NormalizedEntropy", "ctr_metrics"]

_EPS = 1e-12


def _check(preds: torch.Tensor, target: torch.Tensor, name: str) -> None:
    if preds.shape != target.shape:
        raise ValueError(f"{name}: preds {tuple(preds.shape)} and target {tuple(target.shape)} must have one shape.")


class LogLoss(Metric):
    """Mean binary cross entropy (natural log) of probabilities against 0/1 targets.

    Example::

        >>> m = LogLoss()
        >>> m.update(torch.tensor([0.9, 0.2]), torch.tensor([1, 0]))
        >>> round(m.compute().item(), 4)   # -(ln 0.9 + ln 0.8) / 2
        0.1643
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, eps: float = _EPS, **kwargs) -> None:
        super().__init__(**kwargs)
        self.eps = eps
        self.add_state("ce_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
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
    than always predicting the base rate; the same definition as ``torchrec.metrics.ne``.

    Example::

        >>> m = NormalizedEntropy()
        >>> m.update(torch.tensor([0.5, 0.5]), torch.tensor([1, 0]))   # predicting the base rate
        >>> round(m.compute().item(), 6)
        1.0
    """

    def __init__(self, eps: float = _EPS, **kwargs) -> None:
        super().__init__(eps=eps, **kwargs)
        self.add_state("positives", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
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
