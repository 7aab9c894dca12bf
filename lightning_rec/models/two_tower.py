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
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.optim import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec._choices import check_choice
from lightning_rec._module import RecLightningModule
from lightning_rec.config import EmbeddingOptimizer, SparseFeature
from lightning_rec.errors import ExportError
from lightning_rec.metrics import RankingMetrics, TopKMetrics, target_rank, topk_hits
from lightning_rec.models.retrieval_losses import bpr_loss, in_batch_softmax_loss

if TYPE_CHECKING:
    from lightning.pytorch.core.optimizer import LightningOptimizer

__all__ = ["Tower", "TwoTower", "TwoTowerModule", "build_two_tower"]

DEFAULT_CANDIDATE_FEATURES = ["item_id", "genres"]
DEFAULT_SHARED_TABLES: dict[str, list[str]] = {"t_history": ["history", "last_item"]}
TwoTowerLoss = Literal["softmax", "bpr"]


class Tower(nn.Module):
    """An embedding tower: a table collection, an MLP over the pooled embeddings, L2 normalisation.

    With no layers (``layer_sizes=[]``) the pooled embeddings are the output: a tower of one id table is then a
    plain embedding lookup, and two such towers are matrix factorisation.

    Args:
        tables: the collection's tables (put them on ``meta``: the strategy materialises the shards).
        layer_sizes: the MLP's widths; ReLU between layers, none after the last (the output width); empty: no MLP.
        is_weighted: whether the collection pools with the KJT's per-id weights (then every feature needs weights).
        normalize: L2-normalise the output (a dot product of two towers is then a cosine); off: raw dot products.

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
        normalize: bool = True,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("Tower: needs at least one table, got none. HINT: give the tower a feature.")
        self.normalize = normalize
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
        """``(B, D)`` embeddings (L2-normalised when ``normalize``) of the ``B`` samples of ``features``."""
        pooled = self.ebc(features).values()  # the unsharded key order, under any plan
        out = self.mlp(pooled)  # an empty Sequential is the identity
        return F.normalize(out, dim=-1) if self.normalize else out


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
    normalize: bool = True,
) -> TwoTower:
    """A :class:`TwoTower` over ``sparse_features``: ``candidate_features`` go to the candidate tower, the rest to the
    (weighted) query tower. Tables are named ``t_<feature>`` except ``shared_tables`` (table name -> its features,
    e.g. ``{"t_history": ["history", "last_item"]}``, the default), all of width ``embedding_dim``, on ``meta``.
    Empty layer sizes: no MLP (the output is the concatenated pooled embeddings; both towers must then read the same
    number of features). ``normalize``: L2-normalised outputs (see :class:`Tower`).

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
    if not query_layer_sizes or not candidate_layer_sizes:
        n_query = sum(1 for f in sparse_features if f.name not in candidate_features)
        n_candidate = sum(1 for f in sparse_features if f.name in candidate_features)
        q_width = query_layer_sizes[-1] if query_layer_sizes else n_query * embedding_dim
        c_width = candidate_layer_sizes[-1] if candidate_layer_sizes else n_candidate * embedding_dim
        if q_width != c_width:
            raise ValueError(
                f"build_two_tower: the towers' outputs must have one width (a dot product), got query {q_width} "
                f"({n_query} feature(s), layers {list(query_layer_sizes)}) and candidate {c_width} ({n_candidate} "
                f"feature(s), layers {list(candidate_layer_sizes)}). HINT: without an MLP both towers read as many "
                "features (e.g. query user_id, candidate item_id: matrix factorisation), or end both MLPs alike."
            )
    elif list(query_layer_sizes)[-1:] != list(candidate_layer_sizes)[-1:]:
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
        Tower(tables(query_names), query_layer_sizes, is_weighted=True, normalize=normalize),
        Tower(tables(candidate_names), candidate_layer_sizes, is_weighted=False, normalize=normalize),
    )


class TwoTowerModule(RecLightningModule):
    """The two-tower retrieval model trained with :func:`in_batch_softmax_loss` (or :func:`bpr_loss`); validation and
    test report ``recall@k`` and ``ndcg@k`` of each query's held-out item ranked against the whole catalogue (its
    training items excluded), exact across ranks, under ``val/`` and ``test/``.

    Evaluation batches that carry several positives per query (``positive_ids``/``positive_lengths``, as
    :class:`~lightning_rec.data.MovieLensRetrievalDataModule` with ``protocol="recbole"`` makes them) are scored as
    RecBole scores them instead (:func:`~lightning_rec.metrics.topk_hits`: excluded items at ``-inf``, the top
    ``max(ks)`` of ``torch.topk``) and report RecBole's metrics (:class:`~lightning_rec.metrics.TopKMetrics`):
    ``{val,test}/{recall,mrr,ndcg,hit,precision}@k``.

    **Matrix factorisation** (a BPR-like model): the DataModule publishes ``user_id`` and ``item_id`` only, with
    ``candidate_features=["item_id"]``, ``shared_tables={}`` and no MLP (``query_layer_sizes=[]``,
    ``candidate_layer_sizes=[]``): a user's score of an item is the dot product of their two embedding rows
    (``benchmarks/recbole_parity/bpr.yaml``).

    Optimization is manual, with two optimizers: Adam for the towers' MLPs and ``torchrec.optim.RowWiseAdagrad``
    for the tables (the strategy turns it into FBGEMM's fused row-wise Adagrad, which updates the rows inside the
    backward pass). ``trainer.global_step`` counts training steps (batches), as with automatic optimization.

    Args:
        sparse_features: from the DataModule (:class:`~lightning_rec.data.MovieLensRetrievalDataModule`).
        num_dense_features: from the DataModule; must be 0 (the towers read sparse features only).
        embedding_dim, query_layer_sizes, candidate_layer_sizes, candidate_features, shared_tables, normalize: the
            network (:func:`build_two_tower`; empty layer sizes: no MLP).
        temperature: the softmax temperature (with ``loss="bpr"``: the divisor of the score difference).
        loss: ``"softmax"`` (in-batch sampled softmax, :func:`in_batch_softmax_loss`) or ``"bpr"`` (:func:`bpr_loss`
            with one negative per row drawn uniformly from item ids ``1..num_items-1``, as RecBole's uniform
            sampler, which also skips the user's own items; needs ``candidate_features=["item_id"]``).
        mask_duplicates: mask in-batch repeats of a query's positive item.
        logq_correction: the weight of the sampling-bias correction (``logits - logq_correction * log_q``; 0: off).
            On MovieLens-100K it more than doubles recall@10 (BENCHMARKS.md).
        dense_lr: Adam's learning rate (MLPs).
        table_lr, table_eps: row-wise Adagrad's (tables).
        table_weight_decay: row-wise Adagrad's L2 penalty on the rows a batch touches (0: none).
        ks: the cut-offs of the metrics.

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
        normalize: bool = True,
        loss: TwoTowerLoss = "softmax",
        table_weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        check_choice(type(self).__name__, "loss", loss, TwoTowerLoss)
        if loss == "bpr" and list(candidate_features) != ["item_id"]:
            raise ValueError(
                f"TwoTowerModule: loss='bpr' embeds sampled negative item ids alone, so the candidate tower must read "
                f"item_id only, got candidate_features={list(candidate_features)}. HINT: candidate_features: [item_id]."
            )
        if num_dense_features:
            raise ValueError(
                f"TwoTowerModule: the towers read sparse features only, got num_dense_features={num_dense_features}. "
                "HINT: use MovieLensRetrievalDataModule (num_dense_features=0)."
            )
        if not temperature > 0:
            raise ValueError(f"TwoTowerModule: temperature must be > 0, got {temperature}. HINT: e.g. 0.05.")
        self.save_hyperparameters()
        self.model = build_two_tower(
            sparse_features,
            embedding_dim,
            query_layer_sizes,
            candidate_layer_sizes,
            candidate_features,
            shared_tables,
            normalize=normalize,
        )
        self.num_items = max((f.num_embeddings for f in sparse_features if f.name == "item_id"), default=0)
        self.automatic_optimization = False
        self.val_metrics = RankingMetrics(ks, prefix="val/")
        self.test_metrics = RankingMetrics(ks, prefix="test/")
        # several positives per query (RecBole's protocol): RecBole's metrics
        self.val_topk = TopKMetrics(ks, prefix="val/")
        self.test_topk = TopKMetrics(ks, prefix="test/")

    # -- what the towers compute -------------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(query, candidate)`` embeddings of a training-format batch (``{"query": KJT, "candidate": KJT}``)."""
        return self.model(batch["query"], batch["candidate"])

    def loss(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """This rank's share of the global batch's in-batch softmax loss (see :func:`in_batch_softmax_loss`), with
        the logQ correction when ``logq_correction`` is on (the batch's ``candidate_log_q``); or, with
        ``loss="bpr"``, this rank's mean :func:`bpr_loss` against uniformly drawn negatives."""
        q, c = self(batch)
        item_ids = batch["candidate"]["item_id"].values()
        if self.hparams.loss == "bpr":
            negative_ids = torch.randint(1, self.num_items, item_ids.shape, device=item_ids.device)
            negatives = self.model.candidate_tower(
                KeyedJaggedTensor.from_lengths_sync(["item_id"], negative_ids, torch.ones_like(negative_ids).int())
            )
            return bpr_loss(q, c, negatives, self.hparams.temperature)
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
        optimizers = self.optimizers()  # configure_optimizers': [Adam (MLPs), tables], or the tables' alone (no MLP)
        *dense, opt_tables = cast(
            "list[LightningOptimizer]", optimizers if isinstance(optimizers, list) else [optimizers]
        )
        for opt in (*dense, opt_tables):
            opt.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        for opt in dense:
            opt.step()
        # The tables were updated inside the backward pass (fused row-wise Adagrad); this step only runs what the
        # strategy keeps outside FBGEMM (tables on a non-fused kernel). Stepped directly, so that Lightning's
        # `global_step` (and `max_steps`) counts training steps, not two optimizer steps per batch; without an MLP it
        # is the one step, through Lightning (which counts it).
        if dense:
            opt_tables.optimizer.step()
        else:
            opt_tables.step()
        # the mean over ranks is the global batch's mean loss
        self.log("train/loss", loss.detach(), prog_bar=True, sync_dist=True, batch_size=batch["query"].stride())
        return loss.detach()

    def topk_positives(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(query embeddings, top-k hit matrix, positive counts)`` of an evaluation batch with several positives
        per query (``positive_ids``/``positive_lengths``): RecBole's full ranking (:func:`topk_hits`, ``k =
        max(ks)``) of ``batch["candidate"]`` (the catalogue, item id = column), ``exclude_ids`` at ``-inf``."""
        q = self.model.query_tower(batch["query"])
        scores = q @ self.model.candidate_tower(batch["candidate"]).T
        hits, num_positives = topk_hits(
            scores,
            batch["positive_ids"],
            batch["positive_lengths"],
            max(self.hparams.ks),
            batch["exclude_ids"],
            batch["exclude_lengths"],
        )
        return q, hits, num_positives

    def _evaluate(self, batch: Mapping[str, Any], metrics: RankingMetrics, topk: TopKMetrics) -> None:
        if "positive_ids" in batch:
            _, hits, num_positives = self.topk_positives(batch)
            topk.update(hits, num_positives)
            return
        _, rank = self.rank_targets(batch)
        metrics.update(rank)

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics, self.val_topk)

    def test_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, self.test_metrics, self.test_topk)

    @staticmethod
    def _computed(metrics: RankingMetrics, topk: TopKMetrics) -> dict[str, torch.Tensor]:
        """The values of whichever metrics the epoch's batches fed (every rank evaluates the same batch format)."""
        used = topk if bool(topk.count > 0) else metrics
        values = used.compute()
        used.reset()
        return values

    def on_validation_epoch_end(self) -> None:
        # already exact over ranks (summed states): the mean keeps it
        self.log_dict(self._computed(self.val_metrics, self.val_topk), prog_bar=True, sync_dist=True)

    def on_test_epoch_end(self) -> None:
        self.log_dict(self._computed(self.test_metrics, self.test_topk), sync_dist=True)

    def predict_step(
        self, batch: Mapping[str, Any], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, torch.Tensor]:
        """Training-format batch: ``{"query", "candidate", "score"}`` (embeddings and their dot products);
        evaluation-format batch: ``{"query", "target", "rank"}``, or with several positives per query
        ``{"query", "hits", "num_positives"}`` (:meth:`topk_positives`)."""
        if "positive_ids" in batch:
            q, hits, num_positives = self.topk_positives(batch)
            return {"query": q, "hits": hits, "num_positives": num_positives}
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
        table_opt = RowWiseAdagrad(
            self.table_parameters(),
            lr=self.hparams.table_lr,
            eps=self.hparams.table_eps,
            weight_decay=self.hparams.table_weight_decay,
        )
        if not dense:  # no MLP (matrix factorisation): Adam would refuse an empty parameter list
            return [table_opt]
        return [torch.optim.Adam(dense, lr=self.hparams.dense_lr), table_opt]

    def configure_embedding_optimizer(self) -> EmbeddingOptimizer | None:
        return None  # derived from the RowWiseAdagrad above (fused row-wise Adagrad, same lr and eps)
