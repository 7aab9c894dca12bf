"""SASRec- and GRU4Rec-style next-item prediction on an ``EmbeddingCollection``: plain ``nn.Module`` networks and
a thin :class:`~lightning_rec.RecLightningModule` that trains and evaluates them.

:class:`SASRec` (Kang & McAuley, 2018) reads every feature of a sequence batch (see
:mod:`lightning_rec.data.movielens_sequential`) through **one item table shared by four features**
(``history``, ``target``, ``negatives``, ``catalog``), adds learned positional embeddings to the history and runs
causal Transformer blocks over it: position ``t``'s output scores the item at ``t + 1`` by a dot product with
that item's embedding. Training is a sampled softmax per position over the true next item and the row's sampled
negatives; evaluation ranks the whole catalog for the last position, without the items the user has seen.
:class:`GRU4Rec` (Hidasi et al., 2016, as RecBole's ``GRU4Rec``) reads the history with a GRU instead; the
full-softmax loss (RecBole's ``loss_type: CE``) ranks every item of the catalog at each position.

The table lives on ``meta`` until the strategy shards it; the rest is ordinary dense PyTorch (data-parallel).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from lightning_rec._choices import check_arguments
from lightning_rec.config import SEQUENCE_FEATURES, EmbeddingOptimizer, SparseFeature
from lightning_rec.errors import ExportError
from lightning_rec.metrics import RankingMetrics, TopKMetrics, exclusion_mask, target_rank, topk_hits
from lightning_rec.models.base import DenseOptimizerName, TwoOptimizerModule

__all__ = [
    "CausalEncoder",
    "GRU4Rec",
    "GRUEncoder",
    "NextItemQuery",
    "SASRec",
    "SequentialRecModule",
    "catalog_scores",
    "full_softmax_loss",
    "sampled_softmax_loss",
]


def _padded(jt: JaggedTensor, length: int) -> torch.Tensor:
    """``(B, length, D)`` from a JaggedTensor of ``(N, D)`` embeddings (rows left-aligned, zeros after them)."""
    lengths = jt.lengths().long()
    values = jt.values()
    b = lengths.numel()
    rows = torch.repeat_interleave(torch.arange(b, device=values.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(values.shape[0], device=values.device) - starts[rows]
    out = values.new_zeros(b, length, values.shape[1])
    return out.index_put((rows, positions), values)


class CausalEncoder(nn.Module):
    """The dense part of :class:`SASRec`: positional embeddings and causal Transformer blocks over the history
    embeddings; the other features' embeddings are passed on, shaped for scoring.

    Args:
        embedding_dim: the item embedding width (and the model width).
        max_len: the longest history (the number of learned positions).
        num_blocks: Transformer blocks (pre-norm, causal self-attention).
        num_heads: attention heads (must divide ``embedding_dim``).
        dropout: dropout of the embeddings and inside the blocks (0 makes training deterministic given the data).

    Example::

        >>> enc = CausalEncoder(8, max_len=4, num_blocks=1, num_heads=2, dropout=0.0)
        >>> jt = JaggedTensor(values=torch.randn(3, 8), lengths=torch.tensor([2, 1]))
        >>> enc({"history": jt, "target": jt})["hidden"].shape
        torch.Size([2, 4, 8])
    """

    causal: torch.Tensor  # a buffer

    def __init__(
        self, embedding_dim: int, max_len: int, num_blocks: int = 2, num_heads: int = 2, dropout: float = 0.1
    ) -> None:
        super().__init__()
        if embedding_dim % num_heads:
            raise ValueError(
                f"CausalEncoder: num_heads={num_heads} must divide embedding_dim={embedding_dim}. HINT: e.g. num_heads=2."
            )
        if max_len < 1 or num_blocks < 1:
            raise ValueError(
                f"CausalEncoder: max_len ({max_len}) and num_blocks ({num_blocks}) must be >= 1. HINT: e.g. 50 and 2."
            )
        self.embedding_dim, self.max_len = embedding_dim, max_len
        self.position = nn.Embedding(max_len, embedding_dim)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            embedding_dim, num_heads, dim_feedforward=embedding_dim, dropout=dropout, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, num_blocks, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(embedding_dim)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(max_len), persistent=False)

    def reset_parameters(self) -> None:  # the buffer, if built on meta
        self.causal = nn.Transformer.generate_square_subsequent_mask(self.max_len, device=self.causal.device)

    def encode(self, history: JaggedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(hidden, lengths, last)`` of the history's embeddings (see :meth:`forward`)."""
        lengths = history.lengths().long()
        x = _padded(history, self.max_len) * math.sqrt(self.embedding_dim) + self.position.weight.unsqueeze(0)
        hidden = self.norm(self.blocks(self.dropout(x), mask=self.causal, is_causal=True))
        last = hidden[torch.arange(lengths.numel(), device=hidden.device), (lengths - 1).clamp(min=0)]
        return hidden, lengths, last

    def forward(self, embeddings: dict[str, JaggedTensor]) -> dict[str, torch.Tensor]:
        """Encode the history and shape the rest.

        Returns:
            ``hidden`` ``(B, max_len, D)``: position ``t`` encodes the history up to ``t`` (positions past a row's
            length are padding); ``lengths`` ``(B,)``; ``last`` ``(B, D)`` the hidden state at each row's last
            position; ``target`` ``(B, max_len, D)`` the target embeddings, left-aligned; and when present,
            ``negatives`` ``(B, K, D)`` and ``catalog`` ``(C, D)``.
        """
        return _shaped(self.encode(embeddings["history"]), embeddings, self.max_len, self.embedding_dim)


def _shaped(
    encoded: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    embeddings: dict[str, JaggedTensor],
    max_len: int,
    embedding_dim: int,
) -> dict[str, torch.Tensor]:
    """An encoder's output dict (see :meth:`CausalEncoder.forward`) from its ``encode`` and the other features."""
    hidden, lengths, last = encoded
    out = {"hidden": hidden, "lengths": lengths, "last": last, "target": _padded(embeddings["target"], max_len)}
    negatives = embeddings.get("negatives")
    if negatives is not None and negatives.values().numel():
        out["negatives"] = negatives.values().reshape(lengths.numel(), -1, embedding_dim)
    catalog = embeddings.get("catalog")
    if catalog is not None and catalog.values().numel():
        out["catalog"] = catalog.values()
    return out


class GRUEncoder(nn.Module):
    """The dense part of :class:`GRU4Rec`, as RecBole's ``GRU4Rec``: dropout on the history embeddings, a GRU
    without biases, and a linear map of its states back to the embedding width (so they score items by a dot
    product). Same output as :class:`CausalEncoder`.

    Args:
        embedding_dim: the item embedding width (RecBole's ``embedding_size``).
        max_len: the longest history.
        hidden_size: the GRU's state width.
        num_layers: stacked GRU layers.
        dropout: dropout of the history embeddings (RecBole's ``dropout_prob``).

    Example::

        >>> enc = GRUEncoder(8, max_len=4, hidden_size=16)
        >>> jt = JaggedTensor(values=torch.randn(3, 8), lengths=torch.tensor([2, 1]))
        >>> enc({"history": jt, "target": jt})["last"].shape
        torch.Size([2, 8])
    """

    def __init__(
        self, embedding_dim: int, max_len: int, hidden_size: int = 128, num_layers: int = 1, dropout: float = 0.3
    ) -> None:
        super().__init__()
        if max_len < 1 or num_layers < 1 or hidden_size < 1:
            raise ValueError(
                f"GRUEncoder: max_len ({max_len}), hidden_size ({hidden_size}) and num_layers ({num_layers}) must be "
                ">= 1. HINT: e.g. 50, 128 and 1."
            )
        self.embedding_dim, self.max_len = embedding_dim, max_len
        self.dropout = nn.Dropout(dropout)
        self.gru = nn.GRU(embedding_dim, hidden_size, num_layers, bias=False, batch_first=True)
        self.dense = nn.Linear(hidden_size, embedding_dim)

    def encode(self, history: JaggedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(hidden, lengths, last)`` of the history's embeddings (see :meth:`CausalEncoder.forward`); rows are
        left-aligned, so a row's padding never reaches its own positions."""
        lengths = history.lengths().long()
        states, _ = self.gru(self.dropout(_padded(history, self.max_len)))
        hidden = self.dense(states)
        last = hidden[torch.arange(lengths.numel(), device=hidden.device), (lengths - 1).clamp(min=0)]
        return hidden, lengths, last

    def forward(self, embeddings: dict[str, JaggedTensor]) -> dict[str, torch.Tensor]:
        """Encode the history and shape the rest (see :meth:`CausalEncoder.forward`)."""
        return _shaped(self.encode(embeddings["history"]), embeddings, self.max_len, self.embedding_dim)


class SASRec(nn.Module):
    """SASRec: causal self-attention over a user's item history; one item table serves every feature.

    Args:
        num_items: rows of the item table (ids ``0..num_items-1``).
        embedding_dim, max_len, num_blocks, num_heads, dropout: see :class:`CausalEncoder`.
        table_name: the item table's name (what sharding constraints refer to).
        features: the KJT keys the table reads (default :data:`~lightning_rec.config.SEQUENCE_FEATURES`).

    Example::

        >>> net = SASRec(num_items=100, embedding_dim=16, max_len=20)
        >>> net.item_ec.embedding_configs()[0].feature_names
        ['history', 'target', 'negatives', 'catalog']
    """

    def __init__(
        self,
        num_items: int,
        embedding_dim: int = 64,
        max_len: int = 50,
        num_blocks: int = 2,
        num_heads: int = 2,
        dropout: float = 0.1,
        table_name: str = "t_item",
        features: Sequence[str] = SEQUENCE_FEATURES,
    ) -> None:
        super().__init__()
        self.item_ec = _item_table(type(self).__name__, num_items, embedding_dim, table_name, features)
        self.encoder = CausalEncoder(embedding_dim, max_len, num_blocks, num_heads, dropout)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        """Look every feature up in the one item table and encode (see :meth:`CausalEncoder.forward`)."""
        return self.encoder(self.item_ec(features))


def _item_table(
    owner: str, num_items: int, embedding_dim: int, table_name: str, features: Sequence[str]
) -> EmbeddingCollection:
    """The one item table every feature reads, on ``meta`` until the strategy shards it."""
    if num_items < 2:
        raise ValueError(f"{owner}: num_items must be >= 2, got {num_items}. HINT: the item table's size.")
    config = EmbeddingConfig(
        name=table_name, embedding_dim=embedding_dim, num_embeddings=num_items, feature_names=list(features)
    )
    return EmbeddingCollection(tables=[config], device=torch.device("meta"))


class GRU4Rec(nn.Module):
    """GRU4Rec as RecBole builds it: a GRU over the user's item history (:class:`GRUEncoder`); one item table
    serves every feature, as in :class:`SASRec` (same forward and output).

    Args:
        num_items: rows of the item table (ids ``0..num_items-1``).
        embedding_dim, max_len, hidden_size, num_layers, dropout: see :class:`GRUEncoder`.
        table_name, features: see :class:`SASRec`.

    Example::

        >>> net = GRU4Rec(num_items=100, embedding_dim=16, max_len=20, hidden_size=32)
        >>> type(net.encoder).__name__, net.item_ec.embedding_configs()[0].num_embeddings
        ('GRUEncoder', 100)
    """

    def __init__(
        self,
        num_items: int,
        embedding_dim: int = 64,
        max_len: int = 50,
        hidden_size: int = 128,
        num_layers: int = 1,
        dropout: float = 0.3,
        table_name: str = "t_item",
        features: Sequence[str] = SEQUENCE_FEATURES,
    ) -> None:
        super().__init__()
        self.item_ec = _item_table(type(self).__name__, num_items, embedding_dim, table_name, features)
        self.encoder = GRUEncoder(embedding_dim, max_len, hidden_size, num_layers, dropout)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        """Look every feature up in the one item table and encode (see :meth:`CausalEncoder.forward`)."""
        return self.encoder(self.item_ec(features))


class NextItemQuery(nn.Module):
    """What :class:`SASRec` (or :class:`GRU4Rec`) serves: a user's next-item query, the hidden state at the last position of their
    history, ``(B, D)``; an item's score is its dot product with the item's row of the table (as
    :func:`catalog_scores`). It takes the collection's features as a ``KeyedJaggedTensor`` and reads ``history``
    (the others may be empty).

    Example::

        >>> net = SASRec(num_items=10, embedding_dim=8, max_len=4, num_blocks=1, dropout=0.0)
        >>> net.item_ec = EmbeddingCollection(tables=net.item_ec.embedding_configs())  # rows on CPU
        >>> lengths = torch.tensor([2, 1, 0, 0, 0, 0, 0, 0])  # history of 2 users, then target/negatives/catalog
        >>> kjt = KeyedJaggedTensor(keys=list(SEQUENCE_FEATURES), values=torch.tensor([3, 4, 5]), lengths=lengths)
        >>> NextItemQuery(net)(kjt).shape
        torch.Size([2, 8])
    """

    # what a serving artifact takes and says it returns (see lightning_rec.serving.export_inference): only the history,
    # at most max_len ids a user (a longer one has no position to take)
    serving_features = ("history",)
    serving_output = (
        "each user's next-item query, [B, D]: the hidden state at the last position of their history; an item's "
        "score is its dot product with the item's row of the table"
    )

    def __init__(self, net: SASRec | GRU4Rec) -> None:
        super().__init__()
        self.item_ec = net.item_ec
        self.encoder = net.encoder
        self.serving_max_lengths = {"history": net.encoder.max_len}

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        return self.encoder.encode(self.item_ec(sparse_features)["history"])[2]


def _trained(hidden: torch.Tensor, lengths: torch.Tensor, train_from: torch.Tensor | None) -> torch.Tensor:
    """``(B, L)`` bool: the positions that are training examples (inside the row, from ``train_from`` on)."""
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    valid = positions < lengths.unsqueeze(1)
    return valid if train_from is None else valid & (positions >= train_from.to(hidden.device).unsqueeze(1))


def sampled_softmax_loss(
    out: dict[str, torch.Tensor],
    target_ids: torch.Tensor,
    negative_ids: torch.Tensor,
    train_from: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over rows of each row's mean cross entropy over its positions: at every position the true next item
    competes with the row's sampled negatives (a negative equal to the target is left out).

    Args:
        out: :meth:`SASRec.forward`'s output (``hidden``, ``lengths``, ``target``, ``negatives``).
        target_ids: ``(B, max_len)`` the next item ids, left-aligned (padding ignored).
        negative_ids: ``(B, K)`` each row's negatives.
        train_from: ``(B,)`` the first position of each row that counts (the batch's ``train_from``); ``None``: all.

    Example::

        >>> out = {"hidden": torch.zeros(1, 2, 4), "lengths": torch.tensor([2]), "target": torch.zeros(1, 2, 4),
        ...        "negatives": torch.zeros(1, 3, 4)}
        >>> round(sampled_softmax_loss(out, torch.tensor([[5, 6]]), torch.tensor([[1, 2, 3]])).item(), 4)  # ln 4
        1.3863
    """
    hidden, lengths = out["hidden"], out["lengths"]
    positive = (hidden * out["target"]).sum(-1, keepdim=True)  # (B, L, 1)
    negative = torch.einsum("bld,bkd->blk", hidden, out["negatives"])  # (B, L, K)
    negative = negative.masked_fill(negative_ids.unsqueeze(1) == target_ids.unsqueeze(2), float("-inf"))
    logits = torch.cat([positive, negative], dim=-1)
    per_position = torch.logsumexp(logits, -1) - positive.squeeze(-1)  # CE with the target first
    valid = _trained(hidden, lengths, train_from)
    per_row = (per_position * valid).sum(1) / valid.sum(1).clamp(min=1)
    return per_row.mean()


def full_softmax_loss(
    out: dict[str, torch.Tensor], target_ids: torch.Tensor, train_from: torch.Tensor | None = None
) -> torch.Tensor:
    """RecBole's ``loss_type: CE`` (``SequentialRecommender.calculate_loss``): the cross entropy of the next item
    over the whole catalog, averaged over every trained position of the batch (each one an example). Id 0 (padding)
    is never a target and is left out of the softmax.

    Args:
        out: a network's output with ``hidden``, ``lengths`` and ``catalog`` (``(C, D)``: ids ``0..C-1`` in order).
        target_ids: ``(B, max_len)`` the next item ids, left-aligned (padding ignored).
        train_from: ``(B,)`` the first position of each row that counts (the batch's ``train_from``); ``None``: all.

    Example::

        >>> out = {"hidden": torch.zeros(1, 2, 4), "lengths": torch.tensor([2]), "catalog": torch.zeros(5, 4)}
        >>> round(full_softmax_loss(out, torch.tensor([[3, 1]])).item(), 4)  # ln 4: items 1..4 tie
        1.3863
    """
    if "catalog" not in out:
        raise ValueError(
            "full_softmax_loss: the batch has no catalog (every item id) to rank. HINT: train on "
            "MovieLensSequenceDataModule(protocol='recbole'), whose training batches carry it, or use "
            "loss='sampled_softmax'."
        )
    valid = _trained(out["hidden"], out["lengths"], train_from)
    logits = out["hidden"][valid] @ out["catalog"].T  # (N, C): only the trained positions
    logits[:, 0] = float("-inf")
    return F.cross_entropy(logits, target_ids[valid].long())


def catalog_scores(out: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(B, C)``: each row's last hidden state dotted with every catalog item's embedding.

    Example::

        >>> catalog_scores({"last": torch.ones(2, 3), "catalog": torch.eye(3)}).tolist()
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    """
    return out["last"] @ out["catalog"].T


def _padded_ids(jt: JaggedTensor, length: int) -> torch.Tensor:
    return _padded(JaggedTensor(values=jt.values().unsqueeze(1), lengths=jt.lengths()), length).squeeze(-1)


SequenceEncoder = Literal["sasrec", "gru"]
SequenceLoss = Literal["sampled_softmax", "full_softmax"]
SequenceMetrics = Literal["project", "recbole"]


class SequentialRecModule(TwoOptimizerModule):
    """Trains :class:`SASRec` (or :class:`GRU4Rec`) on sequence batches
    (:class:`~lightning_rec.data.MovieLensSequenceDataModule`): sampled softmax (or a full softmax) per position;
    validation and test rank the whole catalog, without the items each batch row lists as seen, and report under
    ``val/`` and ``test/`` (exact across ranks) ``hr@k`` and ``ndcg@k`` (``metrics="project"``), or RecBole's
    ``recall@k``, ``mrr@k``, ``ndcg@k``, ``hit@k`` and ``precision@k`` (``metrics="recbole"``:
    :class:`~lightning_rec.metrics.TopKMetrics` over ``torch.topk``, RecBole's tie rule).

    Args:
        sparse_features: from the DataModule: one feature whose ``num_embeddings`` is the item table's size.
        num_dense_features: from the DataModule (unused; sequence batches have no dense features).
        embedding_dim, max_len, num_blocks, num_heads, dropout: the network (see :class:`SASRec`); ``max_len`` must
            be at least the DataModule's. With ``encoder="gru"``, ``num_blocks`` is the GRU's layers and
            ``dropout`` the history embeddings' (:class:`GRU4Rec`).
        ks: the cut-offs of the ranking metrics.
        encoder: ``"sasrec"`` (:class:`SASRec`) or ``"gru"`` (:class:`GRU4Rec`).
        hidden_size: the GRU's state width (``encoder="gru"``).
        loss: ``"sampled_softmax"`` (:func:`sampled_softmax_loss`: the row's negatives) or ``"full_softmax"``
            (:func:`full_softmax_loss`: every item; the training batches must carry the catalog, as
            ``MovieLensSequenceDataModule(protocol="recbole")``'s do).
        metrics: ``"project"`` or ``"recbole"`` (above).
        embedding_optimizer: the fused optimizer of the item table (default: row-wise Adagrad, lr 0.05).
        dense_optimizer: ``"adam"``, ``"adagrad"`` or ``"sgd"`` for the dense layers.
        dense_lr: its learning rate.
        dense_weight_decay: its weight decay.

    Example::

        dm = MovieLensSequenceDataModule("data/ml-100k", max_len=50)
        model = SequentialRecModule(dm.sparse_features, max_len=50)
        L.Trainer(strategy="recshard", devices=2, max_epochs=20).fit(model, dm)
    """

    def __init__(
        self,
        sparse_features: list[SparseFeature],
        num_dense_features: int = 0,
        embedding_dim: int = 64,
        max_len: int = 50,
        num_blocks: int = 2,
        num_heads: int = 2,
        dropout: float = 0.1,
        ks: list[int] = [10],  # noqa: B006 (jsonargparse shows list defaults)
        embedding_optimizer: EmbeddingOptimizer | None = None,
        dense_optimizer: DenseOptimizerName = "adam",
        dense_lr: float = 1e-3,
        dense_weight_decay: float = 0.0,
        encoder: SequenceEncoder = "sasrec",
        hidden_size: int = 128,
        loss: SequenceLoss = "sampled_softmax",
        metrics: SequenceMetrics = "project",
    ) -> None:
        check_arguments(
            SequentialRecModule.__init__,
            "SequentialRecModule",
            {"encoder": encoder, "loss": loss, "metrics": metrics},
        )
        super().__init__()
        if len(sparse_features) != 1:
            raise ValueError(
                f"SequentialRecModule: expects one sparse feature (the item table), got {[f.name for f in sparse_features]}."
                " HINT: use MovieLensSequenceDataModule, or pass [SparseFeature('item', num_items)]."
            )
        self.save_hyperparameters()
        self.num_items = sparse_features[0].num_embeddings
        self.model: SASRec | GRU4Rec
        if encoder == "gru":
            self.model = GRU4Rec(self.num_items, embedding_dim, max_len, hidden_size, num_blocks, dropout)
        else:
            self.model = SASRec(self.num_items, embedding_dim, max_len, num_blocks, num_heads, dropout)
        self.use_optimizers(embedding_optimizer, dense_optimizer)
        self.val_metrics: RankingMetrics | TopKMetrics
        self.test_metrics: RankingMetrics | TopKMetrics
        if metrics == "recbole":
            self.val_metrics, self.test_metrics = TopKMetrics(ks, prefix="val/"), TopKMetrics(ks, prefix="test/")
        else:
            self.val_metrics = RankingMetrics(ks, prefix="val/", hit_name="hr")
            self.test_metrics = RankingMetrics(ks, prefix="test/", hit_name="hr")

    def setup(self, stage: str) -> None:
        data_len = getattr(getattr(self.trainer, "datamodule", None), "max_len", None)
        if data_len is not None and data_len > self.hparams.max_len:
            raise ValueError(
                f"SequentialRecModule: the DataModule's max_len={data_len} exceeds the model's max_len="
                f"{self.hparams.max_len}. HINT: set model.init_args.max_len >= data.init_args.max_len."
            )
        protocol = getattr(getattr(self.trainer, "datamodule", None), "protocol", None)
        if self.hparams.loss == "full_softmax" and protocol == "project":
            raise ValueError(
                "SequentialRecModule: loss='full_softmax' ranks the catalog, which the DataModule's protocol='project'"
                " training batches do not carry. HINT: data.init_args.protocol: recbole, or loss: sampled_softmax."
            )

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """:meth:`SASRec.forward` on ``batch["features"]``."""
        return self.model(batch["features"])

    def loss(self, batch: dict[str, Any], out: dict[str, torch.Tensor]) -> torch.Tensor:
        """:func:`sampled_softmax_loss` or :func:`full_softmax_loss` (``loss``) of a training batch."""
        features = batch["features"]
        b = batch["users"].numel()
        targets = _padded_ids(features["target"], self.hparams.max_len)
        train_from = batch.get("train_from")
        if self.hparams.loss == "full_softmax":
            return full_softmax_loss(out, targets, train_from)
        return sampled_softmax_loss(out, targets, features["negatives"].values().reshape(b, -1), train_from)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch, self(batch))
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["users"].numel())
        return loss

    def ranks(self, batch: dict[str, Any], out: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``(B,)`` the 0-based rank of each row's held-out item among the catalog items it has not seen."""
        out = self(batch) if out is None else out
        target = batch["features"]["target"].values().long()
        scores = catalog_scores(out)
        mask = exclusion_mask(batch["seen_values"], batch["seen_lengths"], target, scores.shape[1])
        return target_rank(scores, target, mask)

    def _evaluate(self, batch: dict[str, Any], metrics: RankingMetrics | TopKMetrics) -> None:
        if isinstance(metrics, RankingMetrics):
            metrics.update(self.ranks(batch))
            return
        # RecBole's Trainer._full_sort_batch_eval: id 0 and the row's excluded items to -inf, then torch.topk
        target = batch["features"]["target"].values().long()
        scores = catalog_scores(self(batch))
        scores[:, 0] = float("-inf")
        hits, positives = topk_hits(
            scores,
            target,
            torch.ones_like(target),
            max(metrics.ks),
            exclude_ids=batch["seen_values"],
            exclude_lengths=batch["seen_lengths"],
        )
        metrics.update(hits, positives)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, self.test_metrics)

    def _log_ranking(self, metrics: RankingMetrics | TopKMetrics) -> None:
        values = metrics.compute()  # sums over every rank: exact, and the same on every rank
        metrics.reset()
        # sync_dist: the mean of equal values is that value; it only tells Lightning the value is global.
        self.log_dict({k: v.float() for k, v in values.items()}, prog_bar=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self._log_ranking(self.val_metrics)

    def on_test_epoch_end(self) -> None:
        self._log_ranking(self.test_metrics)

    def predict_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        return {"users": batch["users"], "rank": self.ranks(batch)}

    def inference_module(self, part: str | None = None) -> nn.Module:
        """:class:`NextItemQuery` over ``self.model``: serves each user's next-item query ``(B, D)`` from their
        history (see :func:`lightning_rec.serving.export_inference`); items score by a dot product with their rows."""
        if part is not None:
            raise ExportError(f"{type(self).__name__} serves one network; got part={part!r}. HINT: leave `part` out.")
        return NextItemQuery(self.model)
