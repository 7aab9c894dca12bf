"""DLRM and DLRM-DCNv2 for click/rating prediction: TorchRec's plain ``nn.Module``s, trained by a thin
:class:`~lightning_rec.RecLightningModule`.

The networks are ``torchrec.models.dlrm.DLRM`` (dot-product interaction) and ``DLRM_DCN`` (a low-rank
DCNv2 cross network as the interaction); they know nothing of sharding. :class:`DLRMModule` adds the
loss (binary cross entropy on logits), the optimizers and the metrics (:func:`lightning_rec.metrics.ctr_metrics`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN

from lightning_rec.config import EmbeddingOptimizer, SparseFeature
from lightning_rec.models.base import CTRModule, DenseOptimizerName

__all__ = ["DLRMModule", "build_dlrm", "table_configs"]

Interaction = Literal["dot", "dcn"]


def table_configs(features: Sequence[SparseFeature], embedding_dim: int) -> list[EmbeddingBagConfig]:
    """One table per feature, named ``t_<feature>``, all of width ``embedding_dim`` (DLRM needs one width); a
    feature with ``table`` set reads that feature's table (which gets the larger of their sizes).

    Example::

        >>> [t.name for t in table_configs([SparseFeature("user_id", 944)], 16)]
        ['t_user_id']
        >>> shared = table_configs([SparseFeature("item", 50), SparseFeature("history", 50, True, table="item")], 8)
        >>> [(t.name, t.feature_names) for t in shared]
        [('t_item', ['item', 'history'])]
    """
    owners: dict[str, list[SparseFeature]] = {}
    for f in features:
        owners.setdefault(f.table or f.name, []).append(f)
    return [
        EmbeddingBagConfig(
            name=f"t_{table}",
            embedding_dim=embedding_dim,
            num_embeddings=max(f.num_embeddings for f in group),
            feature_names=[f.name for f in group],
        )
        for table, group in owners.items()
    ]


def build_dlrm(
    sparse_features: Sequence[SparseFeature],
    num_dense_features: int,
    embedding_dim: int = 16,
    dense_arch_layer_sizes: Sequence[int] = (64, 16),
    over_arch_layer_sizes: Sequence[int] = (64, 1),
    interaction: Interaction = "dot",
    dcn_num_layers: int = 2,
    dcn_low_rank_dim: int = 16,
) -> DLRM:
    """A DLRM (``interaction="dot"``) or DLRM-DCNv2 (``"dcn"``) whose tables live on the meta device.

    Meta tables cost no memory until the strategy shards them, so a table larger than one rank's memory
    can be declared here. The last dense layer must equal ``embedding_dim`` (the dense vector joins the
    interaction as one more feature) and the last over layer must be 1 (a logit).

    Example::

        >>> net = build_dlrm([SparseFeature("user_id", 944), SparseFeature("item_id", 1683)], 2, embedding_dim=8,
        ...                  dense_arch_layer_sizes=[16, 8])
        >>> type(net).__name__
        'DLRM'
    """
    if not sparse_features:
        raise ValueError("build_dlrm: needs at least one sparse feature.")
    if list(dense_arch_layer_sizes)[-1:] != [embedding_dim]:
        raise ValueError(
            f"build_dlrm: the last dense layer ({list(dense_arch_layer_sizes)}) must equal embedding_dim={embedding_dim}."
            f" HINT: set dense_arch_layer_sizes: [..., {embedding_dim}]."
        )
    if list(over_arch_layer_sizes)[-1:] != [1]:
        raise ValueError(f"build_dlrm: the last over layer must be 1 (one logit), got {list(over_arch_layer_sizes)}.")
    ebc = EmbeddingBagCollection(tables=table_configs(sparse_features, embedding_dim), device=torch.device("meta"))
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=num_dense_features,
        dense_arch_layer_sizes=list(dense_arch_layer_sizes),
        over_arch_layer_sizes=list(over_arch_layer_sizes),
    )
    if interaction == "dot":
        return DLRM(**common)
    if interaction == "dcn":
        return DLRM_DCN(**common, dcn_num_layers=dcn_num_layers, dcn_low_rank_dim=dcn_low_rank_dim)
    raise ValueError(f"build_dlrm: interaction must be 'dot' or 'dcn', got {interaction!r}.")


class DLRMModule(CTRModule):
    """DLRM / DLRM-DCNv2 trained with binary cross entropy; validation and test report AUROC, log loss,
    normalized entropy and accuracy (exact across ranks), under ``val/`` and ``test/``.

    ``sparse_features`` and ``num_dense_features`` come from the DataModule (the CLI links them); the rest is
    the model's own configuration.

    Args:
        sparse_features: one table per feature (see :class:`~lightning_rec.data.SparseFeature`).
        num_dense_features: width of ``batch.dense_features``.
        embedding_dim, dense_arch_layer_sizes, over_arch_layer_sizes, interaction, dcn_num_layers,
            dcn_low_rank_dim: the network (see :func:`build_dlrm`).
        embedding_optimizer: the fused optimizer of the tables (default: row-wise Adagrad, lr 0.05).
        dense_optimizer: ``"adam"``, ``"adagrad"`` or ``"sgd"`` for the MLPs.
        dense_lr: its learning rate.
        dense_weight_decay: its weight decay.

    Example::

        dm = MovieLensDataModule("data/ml-100k")
        model = DLRMModule(dm.sparse_features, dm.num_dense_features, embedding_dim=16)
        L.Trainer(strategy="recshard", devices=2, max_epochs=3).fit(model, dm)
    """

    def __init__(
        self,
        sparse_features: list[SparseFeature],
        num_dense_features: int,
        embedding_dim: int = 16,
        dense_arch_layer_sizes: list[int] = [64, 16],  # noqa: B006 (jsonargparse shows list defaults)
        over_arch_layer_sizes: list[int] = [64, 1],  # noqa: B006
        interaction: Interaction = "dot",
        dcn_num_layers: int = 2,
        dcn_low_rank_dim: int = 16,
        embedding_optimizer: EmbeddingOptimizer | None = None,
        dense_optimizer: DenseOptimizerName = "adam",
        dense_lr: float = 1e-3,
        dense_weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build_dlrm(
            sparse_features,
            num_dense_features,
            embedding_dim,
            dense_arch_layer_sizes,
            over_arch_layer_sizes,
            interaction,
            dcn_num_layers,
            dcn_low_rank_dim,
        )
        self.use_optimizers(embedding_optimizer, dense_optimizer)
