"""Click/rating-prediction metrics as torchmetrics ``Metric``s, exact across ranks.

Log loss and normalized entropy keep sums (cross entropy, positives, count) as states reduced with
``"sum"``, so the value over N ranks is exactly the value over all their rows in one process. AUROC and
accuracy are torchmetrics' own (AUROC gathers every prediction; fine for validation sets, use
``BinaryAUROC(thresholds=...)`` for huge ones).

Inputs are probabilities in ``[0, 1]`` (apply ``sigmoid`` to logits) and targets in ``{0, 1}``.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

__all__ = ["LogLoss", "NormalizedEntropy", "ctr_metrics"]

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
