"""What the shipped LightningModules share: a fused table optimizer next to a dense one chosen by name, and for the
click-prediction models (:class:`CTRModule`) the loss, the metrics and the predictions."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MetricCollection
from torchrec.datasets.utils import Batch

from lightning_rec._module import RecLightningModule
from lightning_rec.config import EmbeddingOptimizer
from lightning_rec.errors import ExportError
from lightning_rec.metrics import ctr_metrics

__all__ = ["CTRModule", "DENSE_OPTIMIZERS", "DenseOptimizerName", "TwoOptimizerModule", "check_labels"]

DenseOptimizerName = Literal["adam", "adagrad", "sgd"]
DENSE_OPTIMIZERS = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}


class TwoOptimizerModule(RecLightningModule):
    """A module whose tables train with a fused :class:`~lightning_rec._strategy.optim.EmbeddingOptimizer` and whose other
    parameters with a dense optimizer named by the hyperparameters ``dense_optimizer``, ``dense_lr`` and
    ``dense_weight_decay`` (a subclass's ``__init__`` takes them and calls ``save_hyperparameters()``).

    Example::

        class MyModel(TwoOptimizerModule):
            def __init__(self, embedding_optimizer=None, dense_optimizer="adam", dense_lr=1e-3, dense_weight_decay=0.0):
                super().__init__()
                self.save_hyperparameters()
                self.use_optimizers(embedding_optimizer, dense_optimizer)
    """

    def use_optimizers(self, embedding_optimizer: EmbeddingOptimizer | None, dense_optimizer: str) -> None:
        """Check the dense optimizer's name and keep the fused one (default: row-wise Adagrad, lr 0.05)."""
        if dense_optimizer not in DENSE_OPTIMIZERS:
            raise ValueError(
                f"{type(self).__name__}: unknown dense_optimizer {dense_optimizer!r}. HINT: choose one of "
                f"{sorted(DENSE_OPTIMIZERS)}."
            )
        self.embedding_optimizer = embedding_optimizer or EmbeddingOptimizer("rowwise_adagrad", lr=0.05)

    def configure_embedding_optimizer(self) -> EmbeddingOptimizer:
        """The fused table optimizer given as ``embedding_optimizer``."""
        return self.embedding_optimizer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The dense optimizer (the strategy leaves the tables to the fused one)."""
        return DENSE_OPTIMIZERS[self.hparams.dense_optimizer](
            self.parameters(), lr=self.hparams.dense_lr, weight_decay=self.hparams.dense_weight_decay
        )


class Probability(nn.Module):
    """Serves a click model: ``sigmoid(net(dense_features, sparse_features))``, shape ``(B,)`` (what
    ``predict_step`` reports as ``"probability"``).

    Example::

        >>> head = Probability(nn.Bilinear(2, 1, 1, bias=False))
        >>> head(torch.zeros(3, 2), torch.zeros(3, 1)).tolist()
        [0.5, 0.5, 0.5]
    """

    serving_output = "the probability of a click (the sigmoid of the model's logit), [B]"  # the served spec's words

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, dense_features: torch.Tensor, sparse_features: Any) -> torch.Tensor:
        return torch.sigmoid(self.net(dense_features, sparse_features).squeeze(-1))


class CTRModule(TwoOptimizerModule):
    """Click prediction on :class:`~lightning_rec._batch.Batch`\\ es: ``self.model(dense, sparse)`` gives logits, trained
    with binary cross entropy; validation and test report AUROC, log loss, normalized entropy and accuracy (exact
    across ranks) under ``val/`` and ``test/``; ``predict_step`` gives ``{"probability", "label"}``.

    Example::

        class MyCTR(CTRModule):
            def __init__(self, sparse_features, num_dense_features, dense_optimizer="adam", dense_lr=1e-3,
                         dense_weight_decay=0.0):
                super().__init__()
                self.save_hyperparameters()
                self.model = build_dlrm(sparse_features, num_dense_features)
                self.use_optimizers(None, dense_optimizer)
    """

    model: nn.Module  # set by the subclass
    # One head, one logit per sample: a DataModule with more label columns (``num_labels``) is refused by name, by
    # `lightning-rec` before any rank starts, else in `setup`, not by a torchmetrics shape error mid-validation.
    num_labels: int = 1

    def __init__(self) -> None:
        super().__init__()
        self.val_metrics = ctr_metrics(prefix="val/")
        self.test_metrics = ctr_metrics(prefix="test/")

    def setup(self, stage: str) -> None:
        """Refuse a DataModule with more label columns than the model has heads (see :func:`check_labels`)."""
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        check_labels(self, datamodule)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits, shape ``(B,)``.

        Example::

            probabilities = torch.sigmoid(model(batch))
        """
        return self.model(batch.dense_features, batch.sparse_features).squeeze(-1)

    def inference_module(self, part: str | None = None) -> nn.Module:
        """:class:`Probability` over ``self.model``: serves ``predict_step``'s probabilities (see
        :func:`lightning_rec.serving.export_inference`)."""
        if part is not None:
            raise ExportError(f"{type(self).__name__} serves one network; got part={part!r}. HINT: leave `part` out.")
        return Probability(self.model)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(self(batch), batch.labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.labels.numel())
        return loss

    def _evaluate(self, batch: Batch, metrics: MetricCollection) -> None:
        metrics.update(torch.sigmoid(self(batch)), batch.labels.long())
        self.log_dict(metrics, prog_bar=True, batch_size=batch.labels.numel())

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_metrics)

    def predict_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        """``{"probability": (B,), "label": (B,)}`` tensors.

        Example::

            preds = trainer.predict(model, dm)    # one dict per batch
        """
        return {"probability": torch.sigmoid(self(batch)), "label": batch.labels}


def check_labels(model: Any, datamodule: Any) -> None:
    """Refuse ``datamodule``'s label columns when the model takes fewer: both say how many through ``num_labels``
    (a :class:`CTRModule` takes one; a :class:`~lightning_rec.data.TabularDataModule` has its schema's). Either
    without ``num_labels`` is not checked.

    Raises:
        ValueError: naming the label columns, the model and how many it takes.

    Example::

        >>> from types import SimpleNamespace
        >>> check_labels(SimpleNamespace(num_labels=1), SimpleNamespace(num_labels=1))
        >>> check_labels(SimpleNamespace(num_labels=1), SimpleNamespace(num_labels=2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: the data has 2 label columns, more labels than the model takes: SimpleNamespace takes 1 ...
    """
    takes, given = getattr(model, "num_labels", None), getattr(datamodule, "num_labels", None)
    if not isinstance(takes, int) or not isinstance(given, int) or given <= takes:
        return
    schema = getattr(datamodule, "schema", None)
    names = [getattr(c, "column", c) for c in getattr(schema, "labels", [])]
    which = f" (schema.labels: {', '.join(map(str, names))})" if names else ""
    raise ValueError(
        f"{type(datamodule).__name__ if schema is not None else 'the data'} has {given} label columns{which}, more "
        f"labels than the model takes: {type(model).__name__} takes {takes} (one output head). HINT: keep one label "
        "column in the schema (one model per label), or use a model with one head per label."
    )
