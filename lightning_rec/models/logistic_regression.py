"""Logistic regression for click/rating prediction: one weight per feature value plus a bias, the first-order
model CTR baselines start from (RecBole's ``LR``), on TorchRec tables so that the strategy shards it like any other.

Each sparse feature reads a table of width 1 (its values' weights; a multi-hot feature sums its values' weights, as
RecBole's ``FMFirstOrderLinear`` sums a ``token_seq`` field), the dense features (if any) a linear map to one number,
and the logit is their sum plus a bias::

    logit = bias + sum_f sum_{v in f} w_f[v] + dense @ w_dense

:class:`LogisticRegressionModule` adds the loss, the optimizers and the metrics (:class:`~lightning_rec.models.base.
CTRModule`: binary cross entropy, AUROC and log loss under ``val/`` and ``test/``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec.config import EmbeddingOptimizer, SparseFeature
from lightning_rec.models.base import CTRModule, DenseOptimizerName
from lightning_rec.models.dlrm import table_configs

__all__ = ["LogisticRegression", "LogisticRegressionModule", "build_logistic_regression"]


class LogisticRegression(nn.Module):
    """The first-order model over one ``EmbeddingBagCollection`` of width-1 tables, returning logits ``(B, 1)``.

    Args:
        embedding_bag_collection: the tables (each of ``embedding_dim`` 1: a weight per row), typically on
            ``device="meta"`` (the strategy shards them).
        num_dense_features: width of the dense input (0: none; the dense features then add nothing).

    Example::

        >>> from torchrec import EmbeddingBagConfig
        >>> ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t_u", embedding_dim=1,
        ...     num_embeddings=10, feature_names=["u"])])
        >>> net = LogisticRegression(ebc, num_dense_features=0)
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["u"], torch.tensor([1, 2]), torch.tensor([1, 1]))
        >>> torch.equal(net(torch.zeros(2, 0), kjt).squeeze(1), ebc(kjt).values().squeeze(1))  # the bias starts at 0
        True
    """

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, num_dense_features: int = 0) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        if not configs:
            raise ValueError(
                "LogisticRegression: needs at least one table. HINT: pass an EmbeddingBagCollection with tables."
            )
        wide = {c.name: c.embedding_dim for c in configs if c.embedding_dim != 1}
        if wide:
            raise ValueError(
                f"LogisticRegression: every table holds one weight per row (embedding_dim 1), got {wide}. "
                "HINT: build the tables with embedding_dim=1 (build_logistic_regression does)."
            )
        if num_dense_features < 0:
            raise ValueError(f"LogisticRegression: num_dense_features must be >= 0, got {num_dense_features}.")
        self.embedding_bag_collection = embedding_bag_collection
        self.dense = nn.Linear(num_dense_features, 1, bias=False) if num_dense_features else None
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """Logits of shape ``(B, 1)``.

        Example::

            logits = net(batch.dense_features, batch.sparse_features)
        """
        # (B, F): one pooled weight per feature, in the collection's key order; their sum is the first-order term.
        logits = self.embedding_bag_collection(sparse_features).values().sum(dim=1, keepdim=True) + self.bias
        if self.dense is not None:
            logits = logits + self.dense(dense_features)
        return logits


def build_logistic_regression(sparse_features: Sequence[SparseFeature], num_dense_features: int) -> LogisticRegression:
    """A :class:`LogisticRegression` with one width-1 table per feature (:func:`~lightning_rec.models.table_configs`)
    on the meta device, so no rank allocates a table before the strategy shards it.

    Example::

        >>> net = build_logistic_regression([SparseFeature("user_id", 944), SparseFeature("item_id", 1683)], 0)
        >>> net.embedding_bag_collection.embedding_bags["t_item_id"].weight.shape
        torch.Size([1683, 1])
    """
    if not sparse_features:
        raise ValueError(
            "build_logistic_regression: needs at least one sparse feature. HINT: sparse_features=[] was passed."
        )
    ebc = EmbeddingBagCollection(tables=table_configs(sparse_features, 1), device=torch.device("meta"))
    return LogisticRegression(ebc, num_dense_features)


class LogisticRegressionModule(CTRModule):
    """Logistic regression trained with binary cross entropy; validation and test report AUROC, log loss,
    normalized entropy and accuracy (exact across ranks), under ``val/`` and ``test/``.

    ``sparse_features`` and ``num_dense_features`` come from the DataModule (the CLI links them). The weights of
    the feature values train with the fused table optimizer, the bias and dense weights with the dense one.

    Args:
        sparse_features: one width-1 table per feature (see :class:`~lightning_rec.data.SparseFeature`).
        num_dense_features: width of ``batch.dense_features`` (0: none).
        embedding_optimizer: the fused optimizer of the tables (default: row-wise Adagrad, lr 0.05).
        dense_optimizer: ``"adam"``, ``"adagrad"`` or ``"sgd"`` for the bias and dense weights.
        dense_lr: its learning rate.
        dense_weight_decay: its weight decay.

    Example::

        dm = MovieLensDataModule("data/ml-100k", protocol="recbole", batch_size=4096)
        model = LogisticRegressionModule(dm.sparse_features, dm.num_dense_features)
        L.Trainer(strategy="recshard", devices=1, max_epochs=10).fit(model, dm)
    """

    def __init__(
        self,
        sparse_features: list[SparseFeature],
        num_dense_features: int,
        embedding_optimizer: EmbeddingOptimizer | None = None,
        dense_optimizer: DenseOptimizerName = "adam",
        dense_lr: float = 1e-3,
        dense_weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build_logistic_regression(sparse_features, num_dense_features)
        self.use_optimizers(embedding_optimizer, dense_optimizer)
