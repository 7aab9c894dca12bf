"""``RecLightningModule``: a LightningModule whose batches carry KeyedJaggedTensors and whose tables are sharded."""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl

from lightning_rec.optim import EmbeddingOptimizer


class RecLightningModule(pl.LightningModule):
    """Base class for recommendation models trained with :class:`~lightning_rec.RecShardStrategy`.

    Write it like any LightningModule. Build embedding modules (``EmbeddingBagCollection`` /
    ``EmbeddingCollection``) anywhere in ``__init__``, preferably on ``device="meta"`` so no rank allocates a
    table it will not own; the strategy plans, shards and materialises them. Batches reach ``training_step``
    as you produced them (a :class:`~lightning_rec.batch.Batch`, or a dict/tuple holding a
    ``KeyedJaggedTensor``), already on the right device.

    The embedding optimizer (FBGEMM, fused into the backward pass) is derived from ``configure_optimizers``:
    the optimizer family and hyperparameters of the param group that holds the embedding parameters. Override
    :meth:`configure_embedding_optimizer` to choose it explicitly instead (row-wise Adagrad is the usual choice
    for large tables); the dense optimizer is then whatever ``configure_optimizers`` returns.

    Example::

        class Model(RecLightningModule):
            def __init__(self):
                super().__init__()
                self.ebc = EmbeddingBagCollection(tables=[...], device=torch.device("meta"))
                self.over = torch.nn.Linear(32, 1)

            def training_step(self, batch, batch_idx):
                pooled = self.ebc(batch.sparse_features).to_dict()  # by name: sharding reorders `.values()`
                x = torch.cat([pooled["user"], pooled["item"]], dim=1)
                return F.binary_cross_entropy_with_logits(self.over(x).squeeze(1), batch.labels)

            def configure_optimizers(self):
                return torch.optim.Adagrad(self.parameters(), lr=0.1)   # tables: fused Adagrad, lr=0.1
    """

    def configure_embedding_optimizer(self) -> Optional[EmbeddingOptimizer]:
        """Declare the fused embedding optimizer explicitly.

        Returns:
            an :class:`~lightning_rec.optim.EmbeddingOptimizer`, or ``None`` (the default) to derive it from the
            param group holding the embedding parameters in ``configure_optimizers``.

        Example::

            def configure_embedding_optimizer(self):
                return EmbeddingOptimizer("rowwise_adagrad", lr=0.05)
        """
        return None
