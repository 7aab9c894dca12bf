"""DeepFM for click/rating prediction: TorchRec's DeepFM parts as a plain ``nn.Module``, trained by a thin
:class:`~lightning_rec.RecLightningModule`.

The network reuses ``torchrec.models.deepfm``: its ``SparseArch`` (the embedding tables), ``DenseArch`` (dense
features projected to one more embedding-sized vector) and ``FMInteractionArch`` (TorchRec's ``DeepFM`` deep
component next to a factorization machine). Three things differ from ``SimpleDeepFMNN``:

* the deep component may have several layers (``deep_layer_sizes``; TorchRec's has one);
* the over arch ends in a logit, not a ``Sigmoid``, so the loss is the numerically stable
  ``binary_cross_entropy_with_logits``;
* the second-order term is by default the DeepFM paper's (:class:`PairwiseFM`: the dot products of every pair of
  embeddings). TorchRec's ``FactorizationMachine`` flattens all embeddings into one vector of ``(F + 1) * D``
  numbers before "square of sum minus sum of squares", so its cross term also multiplies *different*
  dimensions with each other; ``fm="torchrec"`` keeps it (then, with one deep layer and
  ``over_arch_layer_sizes=[1]``, the network is ``SimpleDeepFMNN`` without its final sigmoid). On MovieLens-100K
  the paper's term is the better one (BENCHMARKS.md, "Model zoo: CTR quality").

:class:`DeepFMModule` adds the loss, the optimizers and the metrics (:func:`lightning_rec.metrics.ctr_metrics`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.models.deepfm import DenseArch, FMInteractionArch, SparseArch
from torchrec.modules.deepfm import DeepFM
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec.config import EmbeddingOptimizer, SparseFeature
from lightning_rec.models.base import CTRModule, DenseOptimizerName
from lightning_rec.models.dlrm import table_configs

__all__ = ["DeepFMModule", "DeepFMNN", "PairwiseFM", "build_deepfm"]


FMKind = Literal["paper", "torchrec"]


class PairwiseFM(nn.Module):
    """The DeepFM paper's second-order term: the sum of the dot products of every pair of embeddings.

    Computed as ``0.5 * sum_d[(sum_f v_fd)^2 - sum_f v_fd^2]`` over ``F`` embeddings of one width ``D``. TorchRec's
    ``FactorizationMachine`` flattens the embeddings first, which also multiplies different dimensions with
    each other; this module keeps them apart.

    Example::

        >>> fm = PairwiseFM()
        >>> fm([torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]]), torch.tensor([[0.5, 0.0]])])
        tensor([[13.]])
    """

    def forward(self, embeddings: list[torch.Tensor]) -> torch.Tensor:
        """``(B, 1)`` from a list of ``(B, D)`` embeddings (the call ``FMInteractionArch`` makes)."""
        stacked = torch.stack(embeddings, dim=1)  # (B, F, D)
        square_of_sum = stacked.sum(dim=1).pow(2)
        sum_of_squares = stacked.pow(2).sum(dim=1)
        return 0.5 * (square_of_sum - sum_of_squares).sum(dim=1, keepdim=True)


class DeepFMNN(nn.Module):
    """DeepFM over one ``EmbeddingBagCollection`` (all tables of one width ``D``), returning logits ``(B, 1)``.

    ``dense -> DenseArch -> (B, D)``; ``sparse -> SparseArch -> F x (B, D)``; TorchRec's ``FMInteractionArch``
    concatenates ``[dense (D), deep component (deep_layer_sizes[-1]), FM cross term (1)]``; an MLP of
    ``over_arch_layer_sizes`` (the last being 1) turns that into a logit.

    Args:
        embedding_bag_collection: the tables (typically on ``device="meta"``; the strategy shards them).
        num_dense_features: width of the dense input.
        dense_arch_hidden_size: hidden width of TorchRec's two-layer ``DenseArch``.
        deep_layer_sizes: layers of the deep component (ReLU after each), fed with all ``F + 1`` embeddings.
        over_arch_layer_sizes: layers of the over arch; ReLU between them, the last is the logit (must be 1).
        fm: the second-order term: ``"paper"`` (:class:`PairwiseFM`, per-dimension dot products) or
            ``"torchrec"`` (TorchRec's ``FactorizationMachine`` as ``SimpleDeepFMNN`` uses it).

    Example::

        >>> from torchrec import EmbeddingBagConfig
        >>> ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t_u", embedding_dim=4,
        ...     num_embeddings=10, feature_names=["u"])])
        >>> net = DeepFMNN(ebc, num_dense_features=2, deep_layer_sizes=[8])
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["u"], torch.tensor([1, 2]), torch.tensor([1, 1]))
        >>> net(torch.rand(2, 2), kjt).shape
        torch.Size([2, 1])
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        num_dense_features: int,
        dense_arch_hidden_size: int = 32,
        deep_layer_sizes: Sequence[int] = (64, 32),
        over_arch_layer_sizes: Sequence[int] = (1,),
        fm: FMKind = "paper",
    ) -> None:
        super().__init__()
        if fm not in ("paper", "torchrec"):
            raise ValueError(f"DeepFMNN: fm must be 'paper' or 'torchrec'. HINT: got fm={fm!r}.")
        configs = embedding_bag_collection.embedding_bag_configs()
        if not configs:
            raise ValueError("DeepFMNN: needs at least one table. HINT: pass an EmbeddingBagCollection with tables.")
        dims = {c.name: c.embedding_dim for c in configs}
        if len(set(dims.values())) != 1:
            raise ValueError(
                f"DeepFMNN: every table must have one embedding_dim (FM multiplies them), got {dims}."
                " HINT: build all tables with the same embedding_dim."
            )
        if not deep_layer_sizes:
            raise ValueError("DeepFMNN: deep_layer_sizes=[] leaves no deep component. HINT: e.g. [64, 32].")
        if list(over_arch_layer_sizes)[-1:] != [1]:
            raise ValueError(
                f"DeepFMNN: the last over layer must be 1 (one logit), got over_arch_layer_sizes="
                f"{list(over_arch_layer_sizes)}. HINT: set over_arch_layer_sizes: [..., 1]."
            )
        dim = configs[0].embedding_dim
        feature_names = [name for c in configs for name in c.feature_names]
        fm_in_features = dim * (len(feature_names) + 1)  # the sparse embeddings and the projected dense vector
        self.sparse_arch = SparseArch(embedding_bag_collection)
        self.dense_arch = DenseArch(num_dense_features, dense_arch_hidden_size, dim)
        self.inter_arch = FMInteractionArch(fm_in_features, feature_names, deep_layer_sizes[-1])
        # TorchRec's deep component is one Linear + ReLU; a deeper one is the same DeepFM module around an MLP.
        self.inter_arch.deep_fm = DeepFM(dense_module=MLP(fm_in_features, list(deep_layer_sizes)))
        if fm == "paper":
            self.inter_arch.fm = PairwiseFM()
        over_in = dim + deep_layer_sizes[-1] + 1
        hidden = list(over_arch_layer_sizes[:-1])
        self.over_arch = nn.Sequential(
            MLP(over_in, hidden) if hidden else nn.Identity(), nn.Linear(hidden[-1] if hidden else over_in, 1)
        )

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """Logits of shape ``(B, 1)``.

        Example::

            logits = net(batch.dense_features, batch.sparse_features)
        """
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_features)
        return self.over_arch(self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse))


def build_deepfm(
    sparse_features: Sequence[SparseFeature],
    num_dense_features: int,
    embedding_dim: int = 16,
    dense_arch_hidden_size: int = 32,
    deep_layer_sizes: Sequence[int] = (64, 32),
    over_arch_layer_sizes: Sequence[int] = (1,),
    fm: FMKind = "paper",
) -> DeepFMNN:
    """A :class:`DeepFMNN` with one table per feature (:func:`~lightning_rec.models.table_configs`) on the meta
    device, so no rank allocates a table before the strategy shards it.

    Example::

        >>> net = build_deepfm([SparseFeature("user_id", 944), SparseFeature("item_id", 1683)], 2, embedding_dim=8)
        >>> type(net).__name__, net.sparse_arch.embedding_bag_collection.embedding_bags["t_user_id"].weight.is_meta
        ('DeepFMNN', True)
    """
    if not sparse_features:
        raise ValueError("build_deepfm: needs at least one sparse feature. HINT: sparse_features=[] was passed.")
    if embedding_dim < 1:
        raise ValueError(f"build_deepfm: embedding_dim must be >= 1. HINT: got embedding_dim={embedding_dim}.")
    ebc = EmbeddingBagCollection(tables=table_configs(sparse_features, embedding_dim), device=torch.device("meta"))
    return DeepFMNN(ebc, num_dense_features, dense_arch_hidden_size, deep_layer_sizes, over_arch_layer_sizes, fm)


class DeepFMModule(CTRModule):
    """DeepFM trained with binary cross entropy; validation and test report AUROC, log loss, normalized entropy
    and accuracy (exact across ranks), under ``val/`` and ``test/``.

    ``sparse_features`` and ``num_dense_features`` come from the DataModule (the CLI links them); the rest is
    the model's own configuration.

    Args:
        sparse_features: one table per feature (see :class:`~lightning_rec.data.SparseFeature`).
        num_dense_features: width of ``batch.dense_features``.
        embedding_dim, dense_arch_hidden_size, deep_layer_sizes, over_arch_layer_sizes, fm: the network (see
            :class:`DeepFMNN`).
        embedding_optimizer: the fused optimizer of the tables (default: row-wise Adagrad, lr 0.05).
        dense_optimizer: ``"adam"``, ``"adagrad"`` or ``"sgd"`` for the MLPs.
        dense_lr: its learning rate.
        dense_weight_decay: its weight decay.

    Example::

        dm = MovieLensDataModule("data/ml-100k")
        model = DeepFMModule(dm.sparse_features, dm.num_dense_features, embedding_dim=16)
        L.Trainer(strategy="recshard", devices=2, max_epochs=3).fit(model, dm)
    """

    def __init__(
        self,
        sparse_features: list[SparseFeature],
        num_dense_features: int,
        embedding_dim: int = 16,
        dense_arch_hidden_size: int = 32,
        deep_layer_sizes: list[int] = [64, 32],  # noqa: B006 (jsonargparse shows list defaults)
        over_arch_layer_sizes: list[int] = [1],  # noqa: B006
        fm: FMKind = "paper",
        embedding_optimizer: EmbeddingOptimizer | None = None,
        dense_optimizer: DenseOptimizerName = "adam",
        dense_lr: float = 1e-3,
        dense_weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build_deepfm(
            sparse_features,
            num_dense_features,
            embedding_dim,
            dense_arch_hidden_size,
            deep_layer_sizes,
            over_arch_layer_sizes,
            fm,
        )
        self.use_optimizers(embedding_optimizer, dense_optimizer)
