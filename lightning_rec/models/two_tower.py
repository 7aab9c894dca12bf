"""A two-tower retrieval model: a query tower (user features + weighted history) and a candidate tower (item id +
genres), trained with an in-batch softmax (logQ-corrected) whose negatives are the candidates of the *global* batch.

The networks are plain ``nn.Module``s (:class:`Tower`, :class:`TwoTower`) that know nothing of sharding; either tower
embeds on its own (``model.query_tower(kjt)``, ``model.candidate_tower(kjt)``: ``(B, D)``, L2-normalised), also
after ``TwoTowerModule.load_from_checkpoint(...)`` in one process. :class:`TwoTowerModule` adds the loss
(:func:`in_batch_softmax_loss`), two optimizers driven by hand (Adam for the towers' MLPs, row-wise Adagrad for the
tables, fused into the backward pass by the strategy), and recall@k / NDCG@k over the whole catalogue.

Tables (one per feature, named ``t_<feature>``, all on ``meta``): the query tower's collection is ``is_weighted``
(every feature carries per-id weights: 1 for the user features, e.g. stars / 5 for ``history``), and ``history`` and
``last_item`` share one table, ``t_history`` (a user's newest positive is looked up in the same item rows as the
rest of their history, pooled separately).

**Exact on several ranks.** Each rank embeds its share of the batch; the candidate embeddings (and their item ids)
of all ranks are gathered with gradients (summed back to their rank in the backward pass), so each rank scores its
queries against the global batch's candidates. Each rank's loss is its queries' summed cross entropy times
``world_size / global batch size``: the mean over ranks (what DDP's gradient averaging and TorchRec's gradient
division apply) is then the whole batch's mean loss, even when ranks hold batches of different sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.optim import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec._module import RecLightningModule
from lightning_rec.config import EmbeddingOptimizer, SparseFeature
from lightning_rec.errors import ExportError
from lightning_rec.metrics import RankingMetrics, target_rank

if TYPE_CHECKING:
    from lightning.pytorch.core.optimizer import LightningOptimizer

__all__ = ["Tower", "TwoTower", "TwoTowerModule", "build_two_tower", "gather_candidates", "in_batch_softmax_loss"]

DEFAULT_CANDIDATE_FEATURES = ["item_id", "genres"]
DEFAULT_SHARED_TABLES: dict[str, list[str]] = {"t_history": ["history", "last_item"]}


class Tower(nn.Module):
    """An embedding tower: a table collection, an MLP over the pooled embeddings, L2 normalisation.

    Args:
        tables: the collection's tables (put them on ``meta``: the strategy materialises the shards).
        layer_sizes: the MLP's widths; ReLU between layers, none after the last (the output width).
        is_weighted: whether the collection pools with the KJT's per-id weights (then every feature needs weights).

    Example::

        >>> tower = Tower([EmbeddingBagConfig(name="t_item_id", embedding_dim=8, num_embeddings=10,
        ...                                   feature_names=["item_id"])], [16, 4], device=torch.device("cpu"))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["item_id"], torch.tensor([3, 7]), torch.tensor([1, 1]))
        >>> tower(kjt).shape, bool(torch.allclose(tower(kjt).norm(dim=1), torch.ones(2)))
        (torch.Size([2, 4]), True)
    """

    serving_output = "each sample's L2-normalised embedding, [B, D] (a query and a candidate score by dot product)"

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        layer_sizes: Sequence[int],
        is_weighted: bool = False,
        device: torch.device = torch.device("meta"),  # noqa: B008 (a constant: tables start on meta)
    ) -> None:
        super().__init__()
        if not tables or not layer_sizes:
            raise ValueError(
                f"Tower: needs tables and layer sizes, got {len(tables)} table(s), layers {list(layer_sizes)}. "
                "HINT: e.g. layer_sizes=[64, 32]."
            )
        self.ebc = EmbeddingBagCollection(tables=tables, is_weighted=is_weighted, device=device)
        width = sum(t.embedding_dim * len(t.feature_names) for t in tables)
        layers: list[nn.Module] = []
        for i, size in enumerate(layer_sizes):
            layers.append(nn.Linear(width, size))
            if i < len(layer_sizes) - 1:
                layers.append(nn.ReLU())
            width = size
        self.mlp = nn.Sequential(*layers)

    @property
    def feature_names(self) -> list[str]:
        """The features the collection reads, in the order its pooled output concatenates them."""
        return [f for t in self.ebc.embedding_bag_configs() for f in t.feature_names]

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """``(B, D)`` L2-normalised embeddings of the ``B`` samples of ``features``."""
        pooled = self.ebc(features).values()  # the unsharded key order, under any plan
        return F.normalize(self.mlp(pooled), dim=-1)


class TwoTower(nn.Module):
    """The query tower and the candidate tower; ``forward`` embeds both sides of a batch.

    Args:
        query_tower, candidate_tower: two :class:`Tower` s with the same output width.

    Example::

        net = build_two_tower(dm.sparse_features, embedding_dim=16)
        q, c = net(batch["query"], batch["candidate"])        # (B, D) each
        item_vectors = net.candidate_tower(catalogue_kjt)      # a tower on its own
    """

    def __init__(self, query_tower: Tower, candidate_tower: Tower) -> None:
        super().__init__()
        self.query_tower = query_tower
        self.candidate_tower = candidate_tower

    def forward(self, query: KeyedJaggedTensor, candidate: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(query embeddings, candidate embeddings)``, each ``(B, D)`` and L2-normalised."""
        return self.query_tower(query), self.candidate_tower(candidate)


def build_two_tower(
    sparse_features: Sequence[SparseFeature],
    embedding_dim: int = 32,
    query_layer_sizes: Sequence[int] = (64, 32),
    candidate_layer_sizes: Sequence[int] = (64, 32),
    candidate_features: Sequence[str] = tuple(DEFAULT_CANDIDATE_FEATURES),
    shared_tables: Mapping[str, Sequence[str]] | None = None,
) -> TwoTower:
    """A :class:`TwoTower` over ``sparse_features``: ``candidate_features`` go to the candidate tower, the rest to the
    (weighted) query tower. Tables are named ``t_<feature>`` except ``shared_tables`` (table name -> its features,
    e.g. ``{"t_history": ["history", "last_item"]}``, the default), all of width ``embedding_dim``, on ``meta``.

    Example::

        >>> fs = [SparseFeature("user_id", 10), SparseFeature("history", 20, True),
        ...       SparseFeature("last_item", 20, True), SparseFeature("item_id", 20), SparseFeature("genres", 5, True)]
        >>> net = build_two_tower(fs, embedding_dim=8, query_layer_sizes=[8], candidate_layer_sizes=[8])
        >>> [t.name for t in net.query_tower.ebc.embedding_bag_configs()], net.query_tower.feature_names
        (['t_user_id', 't_history'], ['user_id', 'history', 'last_item'])
    """
    shared = {k: list(v) for k, v in (DEFAULT_SHARED_TABLES if shared_tables is None else shared_tables).items()}
    by_name = {f.name: f for f in sparse_features}
    missing = [f for f in [*candidate_features, *(f for fs in shared.values() for f in fs)] if f not in by_name]
    if missing:
        raise ValueError(
            f"build_two_tower: feature(s) {missing} are not among the sparse features {list(by_name)}. HINT: use "
            "MovieLensRetrievalDataModule's features, or set candidate_features / shared_tables to names it publishes."
        )
    if list(query_layer_sizes)[-1:] != list(candidate_layer_sizes)[-1:]:
        raise ValueError(
            f"build_two_tower: the towers' last layers must have one width (a dot product), got query "
            f"{list(query_layer_sizes)} and candidate {list(candidate_layer_sizes)}. HINT: end both with the same size."
        )
    table_of = {f: table for table, fs in shared.items() for f in fs}

    def tables(names: list[str]) -> list[EmbeddingBagConfig]:
        out: dict[str, EmbeddingBagConfig] = {}
        for name in names:
            table = table_of.get(name, f"t_{name}")
            if table in out:
                continue
            features = shared.get(table, [name])
            if any(f not in names for f in features):
                raise ValueError(f"build_two_tower: shared table {table!r} mixes the towers' features {features}.")
            rows = max(by_name[f].num_embeddings for f in features)
            out[table] = EmbeddingBagConfig(
                name=table, embedding_dim=embedding_dim, num_embeddings=rows, feature_names=features
            )
        return list(out.values())

    query_names = [f.name for f in sparse_features if f.name not in candidate_features]
    candidate_names = [f.name for f in sparse_features if f.name in candidate_features]
    return TwoTower(
        Tower(tables(query_names), query_layer_sizes, is_weighted=True),
        Tower(tables(candidate_names), candidate_layer_sizes, is_weighted=False),
    )


class _GatherRows(torch.autograd.Function):
    """All ranks' ``(n, k)`` tensors (one size everywhere) stacked in rank order, ``(world * n, k)``; the gradient of
    this rank's rows is the sum of every rank's gradient of them (an all-reduce of the whole gradient, then this
    rank's slice: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, rows.contiguous())
        ctx.n = rows.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        start = dist.get_rank() * ctx.n
        return grad[start : start + ctx.n]


def gather_candidates(
    candidates: torch.Tensor, item_ids: torch.Tensor, log_q: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Every rank's candidate embeddings (with gradients), item ids and log sampling probabilities, in rank order.

    One collective carries all three (ids and ``log_q`` ride along as extra float64 columns: ids are exact below
    2**53), after a tiny one for the ranks' batch sizes, which may differ (padded for the collective, then cut).
    Without an initialised process group (or with one rank) the inputs come back unchanged.

    Returns:
        ``(global candidates (N, D), global item ids (N,), global log_q (N,) or None, offset of this rank's rows)``.

    Example::

        c_all, ids_all, _, offset = gather_candidates(c, batch_item_ids)
        labels = offset + torch.arange(c.shape[0])
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return candidates, item_ids, log_q, 0
    world, rank = dist.get_world_size(), dist.get_rank()
    local = torch.tensor([candidates.shape[0]], device=candidates.device, dtype=torch.long)
    sizes = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(sizes, local)
    counts = [int(s) for s in sizes]
    columns = [candidates.double(), item_ids.double().unsqueeze(1)]
    if log_q is not None:
        columns.append(log_q.double().unsqueeze(1))
    packed = torch.cat(columns, dim=1)
    packed = F.pad(packed, (0, 0, 0, max(counts) - packed.shape[0]))
    parts = _GatherRows.apply(packed).split(max(counts))  # backward: every rank's gradient of this rank's rows, summed
    gathered = torch.cat([part[:n] for part, n in zip(parts, counts)])
    width = candidates.shape[1]
    return (
        gathered[:, :width].to(candidates.dtype),
        gathered[:, width].long(),
        gathered[:, width + 1].to(log_q.dtype) if log_q is not None else None,
        sum(counts[:rank]),
    )


def in_batch_softmax_loss(
    queries: torch.Tensor,
    candidates: torch.Tensor,
    item_ids: torch.Tensor,
    temperature: float = 0.05,
    mask_duplicates: bool = True,
    log_q: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sampled-softmax loss with in-batch negatives, over the global batch on several ranks.

    Query ``i`` (of this rank) should score its own candidate above every other candidate of the global batch
    (:func:`gather_candidates`): ``logits[i, j] = q_i . c_j / temperature - log_q[j]``. ``log_q`` (optional) is each
    candidate's log probability of appearing in a batch; subtracting it is the sampling-bias ("logQ") correction of
    Yi et al. (RecSys 2019): popular items are in-batch negatives more often, and would otherwise be pushed down.
    ``mask_duplicates`` drops other columns holding query ``i``'s positive item (they are not negatives).

    The value is ``sum of this rank's cross entropies * world_size / global batch size``: its mean over ranks (what
    DDP and TorchRec's gradient division average) is the global batch's mean cross entropy; one process: the mean.

    Args:
        queries, candidates: ``(B, D)`` embeddings of this rank's pairs.
        item_ids: ``(B,)`` the candidates' item ids.
        temperature: the softmax temperature.
        mask_duplicates: mask in-batch repeats of the positive item.
        log_q: ``(B,)`` log sampling probabilities of the candidates, or ``None`` for no correction.

    Example::

        >>> q = F.normalize(torch.randn(4, 8), dim=1); c = F.normalize(torch.randn(4, 8), dim=1)
        >>> loss = in_batch_softmax_loss(q, c, torch.tensor([1, 2, 3, 4]), temperature=1.0)
        >>> bool(torch.isclose(loss, F.cross_entropy(q @ c.T, torch.arange(4))))
        True
    """
    if not temperature > 0:
        raise ValueError(f"in_batch_softmax_loss: temperature must be > 0, got {temperature}. HINT: e.g. 0.05.")
    all_c, all_ids, all_log_q, offset = gather_candidates(candidates, item_ids, log_q)
    logits = queries @ all_c.T / temperature
    if all_log_q is not None:
        logits = logits - all_log_q.unsqueeze(0)
    rows = torch.arange(queries.shape[0], device=queries.device)
    labels = offset + rows
    if mask_duplicates:
        same = item_ids.unsqueeze(1) == all_ids.unsqueeze(0)
        same[rows, labels] = False
        logits = logits.masked_fill(same, float("-inf"))
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return F.cross_entropy(logits, labels, reduction="sum") * (world / all_c.shape[0])


class TwoTowerModule(RecLightningModule):
    """The two-tower retrieval model trained with :func:`in_batch_softmax_loss`; validation and test report
    ``recall@k`` and ``ndcg@k`` of each query's held-out item ranked against the whole catalogue (its training
    items excluded), exact across ranks, under ``val/`` and ``test/``.

    Optimization is manual, with two optimizers: Adam for the towers' MLPs and ``torchrec.optim.RowWiseAdagrad``
    for the tables (the strategy turns it into FBGEMM's fused row-wise Adagrad, which updates the rows inside the
    backward pass). ``trainer.global_step`` counts training steps (batches), as with automatic optimization.

    Args:
        sparse_features: from the DataModule (:class:`~lightning_rec.data.MovieLensRetrievalDataModule`).
        num_dense_features: from the DataModule; must be 0 (the towers read sparse features only).
        embedding_dim, query_layer_sizes, candidate_layer_sizes, candidate_features, shared_tables: the network
            (:func:`build_two_tower`).
        temperature: the softmax temperature.
        mask_duplicates: mask in-batch repeats of a query's positive item.
        logq_correction: the weight of the sampling-bias correction (``logits - logq_correction * log_q``; 0: off).
            On MovieLens-100K it more than doubles recall@10 (BENCHMARKS.md).
        dense_lr: Adam's learning rate (MLPs).
        table_lr, table_eps: row-wise Adagrad's (tables).
        ks: the cut-offs of recall/NDCG.

    Example::

        dm = MovieLensRetrievalDataModule("data/ml-100k")
        model = TwoTowerModule(dm.sparse_features)
        L.Trainer(strategy="recshard", devices=2, max_epochs=5).fit(model, dm)
        items = model.model.candidate_tower(catalogue_kjt)      # after training: a tower on its own
    """

    def __init__(
        self,
        sparse_features: list[SparseFeature],
        num_dense_features: int = 0,
        embedding_dim: int = 32,
        query_layer_sizes: list[int] = [64, 32],  # noqa: B006 (jsonargparse shows list defaults)
        candidate_layer_sizes: list[int] = [64, 32],  # noqa: B006
        candidate_features: list[str] = DEFAULT_CANDIDATE_FEATURES,  # noqa: B006
        shared_tables: dict[str, list[str]] = DEFAULT_SHARED_TABLES,  # noqa: B006
        temperature: float = 0.05,
        mask_duplicates: bool = True,
        logq_correction: float = 1.0,
        dense_lr: float = 1e-3,
        table_lr: float = 0.05,
        table_eps: float = 1e-8,
        ks: list[int] = [10, 50],  # noqa: B006
    ) -> None:
        super().__init__()
        if num_dense_features:
            raise ValueError(
                f"TwoTowerModule: the towers read sparse features only, got num_dense_features={num_dense_features}. "
                "HINT: use MovieLensRetrievalDataModule (num_dense_features=0)."
            )
        if not temperature > 0:
            raise ValueError(f"TwoTowerModule: temperature must be > 0, got {temperature}. HINT: e.g. 0.05.")
        self.save_hyperparameters()
        self.model = build_two_tower(
            sparse_features, embedding_dim, query_layer_sizes, candidate_layer_sizes, candidate_features, shared_tables
        )
        self.automatic_optimization = False
        self.val_metrics = RankingMetrics(ks, prefix="val/")
        self.test_metrics = RankingMetrics(ks, prefix="test/")

    # -- what the towers compute -------------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(query, candidate)`` embeddings of a training-format batch (``{"query": KJT, "candidate": KJT}``)."""
        return self.model(batch["query"], batch["candidate"])

    def loss(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """This rank's share of the global batch's in-batch softmax loss (see :func:`in_batch_softmax_loss`), with
        the logQ correction when ``logq_correction`` is on (the batch's ``candidate_log_q``)."""
        q, c = self(batch)
        item_ids = batch["candidate"]["item_id"].values()
        log_q = None
        if self.hparams.logq_correction:
            if "candidate_log_q" not in batch:
                raise ValueError(
                    f"TwoTowerModule: logq_correction={self.hparams.logq_correction} needs the batch's "
                    f"'candidate_log_q' (log sampling probability of each candidate); the batch has {sorted(batch)}. "
                    "HINT: use MovieLensRetrievalDataModule's training batches, or set logq_correction=0."
                )
            log_q = batch["candidate_log_q"] * self.hparams.logq_correction
        return in_batch_softmax_loss(
            q, c, item_ids, self.hparams.temperature, self.hparams.mask_duplicates, log_q=log_q
        )

    def rank_targets(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(query embeddings, 0-based rank of each target)`` of an evaluation batch: every item of
        ``batch["candidate"]`` (the catalogue, item id = column) is scored, ``exclude_ids`` are left out."""
        q = self.model.query_tower(batch["query"])
        items = self.model.candidate_tower(batch["candidate"])
        scores = q @ items.T
        exclude = torch.zeros_like(scores, dtype=torch.bool)
        rows = torch.repeat_interleave(torch.arange(q.shape[0], device=q.device), batch["exclude_lengths"])
        exclude[rows, batch["exclude_ids"]] = True
        return q, target_rank(scores, batch["target"], exclude)

    # -- Lightning hooks ---------------------------------------------------------------------------------
    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        opt_dense, opt_tables = cast("list[LightningOptimizer]", self.optimizers())  # configure_optimizers' two
        opt_dense.zero_grad()
        opt_tables.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        opt_dense.step()
        # The tables were updated inside the backward pass (fused row-wise Adagrad); this step only runs what the
        # strategy keeps outside FBGEMM (tables on a non-fused kernel). Stepped directly, so that Lightning's
        # `global_step` (and `max_steps`) counts training steps, not two optimizer steps per batch.
        opt_tables.optimizer.step()
        # the mean over ranks is the global batch's mean loss
        self.log("train/loss", loss.detach(), prog_bar=True, sync_dist=True, batch_size=batch["query"].stride())
        return loss.detach()

    def _evaluate(self, batch: Mapping[str, Any], metrics: RankingMetrics) -> None:
        _, rank = self.rank_targets(batch)
        metrics.update(rank)

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics)

    def test_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, self.test_metrics)

    def on_validation_epoch_end(self) -> None:
        self.log_dict(
            self.val_metrics.compute(), prog_bar=True, sync_dist=True
        )  # already exact over ranks: the mean keeps it
        self.val_metrics.reset()

    def on_test_epoch_end(self) -> None:
        self.log_dict(self.test_metrics.compute(), sync_dist=True)
        self.test_metrics.reset()

    def predict_step(
        self, batch: Mapping[str, Any], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, torch.Tensor]:
        """Training-format batch: ``{"query", "candidate", "score"}`` (embeddings and their dot products);
        evaluation-format batch: ``{"query", "target", "rank"}``."""
        if "target" in batch:
            q, rank = self.rank_targets(batch)
            return {"query": q, "target": batch["target"], "rank": rank}
        q, c = self(batch)
        return {"query": q, "candidate": c, "score": (q * c).sum(1)}

    def inference_module(self, part: str | None = None) -> nn.Module:
        """One tower, for serving (see :func:`lightning_rec.serving.export_inference`): ``part="query"`` embeds
        queries (users), ``"candidate"`` embeds items; each takes a ``KeyedJaggedTensor`` of its features and
        returns ``(B, D)`` L2-normalised embeddings."""
        towers = {"query": self.model.query_tower, "candidate": self.model.candidate_tower}
        if part not in towers:
            raise ExportError(
                f"{type(self).__name__} serves two towers; choose one with part='query' or part='candidate', got "
                f"{part!r}."
            )
        return towers[part]

    def table_parameters(self) -> list[nn.Parameter]:
        """The parameters of both towers' table collections."""
        return [*self.model.query_tower.ebc.parameters(), *self.model.candidate_tower.ebc.parameters()]

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        tables = {id(p) for p in self.table_parameters()}
        dense = [p for p in self.parameters() if id(p) not in tables]
        return [
            torch.optim.Adam(dense, lr=self.hparams.dense_lr),
            RowWiseAdagrad(self.table_parameters(), lr=self.hparams.table_lr, eps=self.hparams.table_eps),
        ]

    def configure_embedding_optimizer(self) -> EmbeddingOptimizer | None:
        return None  # derived from the RowWiseAdagrad above (fused row-wise Adagrad, same lr and eps)
