"""The two-tower module as matrix factorisation (a BPR-like model) under RecBole's general protocol: towers without
an MLP are embedding rows, the BPR loss, RecBole's full-ranking metrics against a brute-force RecBole computation,
and one lean fit whose logged test metrics are recomputed from the saved checkpoint."""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_rec import RecShardStrategy
from lightning_rec._pretrained import load_rows
from lightning_rec.data.movielens_retrieval import MovieLensRetrievalDataModule
from lightning_rec.models import TwoTowerModule
from lightning_rec.models.retrieval_losses import bpr_loss
from tests.helpers.data import movielens_dir
from tests.helpers.dist import in_this_process
from tests.test_topk_metrics import recbole_metrics

MF = dict(query_layer_sizes=[], candidate_layer_sizes=[], candidate_features=["item_id"], shared_tables={}, ks=[5, 10])
KEYS = [f"test/{m}@{k}" for k in (5, 10) for m in ("recall", "mrr", "ndcg", "hit", "precision")]


@pytest.fixture(scope="module")
def dm() -> MovieLensRetrievalDataModule:
    return MovieLensRetrievalDataModule(
        str(movielens_dir()), download=False, protocol="recbole", batch_size=512, eval_batch_size=400
    )


def seeded_mf(
    dm: MovieLensRetrievalDataModule, dim: int = 8, **kwargs: Any
) -> tuple[TwoTowerModule, torch.Tensor, torch.Tensor]:
    """An MF module whose user and item rows are seeded random draws (returned too)."""
    module = TwoTowerModule(dm.sparse_features, embedding_dim=dim, **{**MF, **kwargs})
    g = torch.Generator().manual_seed(0)
    users, items = torch.randn(944, dim, generator=g), torch.randn(1683, dim, generator=g)
    load_rows(module, {"t_user_id": users, "t_item_id": items})
    return module.eval(), users, items


def brute_force(dm: MovieLensRetrievalDataModule, users: torch.Tensor, items: torch.Tensor, split: str) -> dict:
    """RecBole's evaluation from the split's parts: scores U @ V.T; id 0 and the user's history (validation: its
    training items; test: training and validation items) at -inf; torch.topk; RecBole's metric formulas."""
    phase = {"val": 1, "test": 2}[split]
    parts = dm.splits.parts
    evaluated = [u for u in sorted(parts) if parts[u][phase]]
    scores = users[evaluated] @ items.T
    scores[:, 0] = -np.inf
    positive = torch.zeros_like(scores, dtype=torch.int)
    for row, u in enumerate(evaluated):
        history = set().union(*parts[u][:phase]) - set(parts[u][phase])
        scores[row, sorted(history)] = -np.inf
        positive[row, parts[u][phase]] = 1
    _, top = torch.topk(scores, 10, dim=-1)
    expected = recbole_metrics(positive.gather(1, top).bool().numpy(), positive.sum(1).numpy(), (5, 10))
    return {f"{split}/{k}": v for k, v in expected.items()}


def test_towers_without_mlp_are_embedding_rows(dm: MovieLensRetrievalDataModule) -> None:
    raw, users, items = seeded_mf(dm, normalize=False)
    cosine, _, _ = seeded_mf(dm)
    rows = dm.split("test")
    with torch.no_grad():
        assert torch.equal(raw.model.query_tower(rows.query(torch.tensor([0, 7]))), users[rows.user[[0, 7]]])
        assert torch.equal(raw.model.candidate_tower(rows.candidate(torch.tensor([3, 1682]))), items[[3, 1682]])
        assert torch.allclose(cosine.model.candidate_tower(rows.candidate(torch.tensor([3]))), F.normalize(items[[3]]))
    assert not [p for n, p in raw.named_parameters() if "mlp" in n], "no MLP"
    with pytest.raises(ValueError, match=r"outputs must have one width.*query 16 \(2 feature\(s\).*candidate 8.*HINT"):
        TwoTowerModule(
            MovieLensRetrievalDataModule(str(movielens_dir()), download=False).sparse_features[:2]
            + dm.sparse_features[1:],
            embedding_dim=8,
            **MF,
        )


def test_recbole_metrics_equal_a_brute_force_recbole_evaluation(dm: MovieLensRetrievalDataModule) -> None:
    module, users, items = seeded_mf(dm, normalize=False)
    for split in ("val", "test"):
        rows = dm.split(split)
        ranking, topk = (
            (module.val_metrics, module.val_topk) if split == "val" else (module.test_metrics, module.test_topk)
        )
        for index in torch.arange(len(rows)).split(400):  # several batches, as the loader gives them
            with torch.no_grad():
                _, hits, n = module.topk_positives(rows[index])
            topk.update(hits, n)
        got = {k: float(v) for k, v in module._computed(ranking, topk).items()}
        expected = brute_force(dm, users, items, split)
        assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert expected[f"{split}/hit@10"] > 0.02, "random rows must hit something, or the check is vacuous"


def test_bpr_loss_and_its_option(dm: MovieLensRetrievalDataModule) -> None:
    q, p, n = torch.randn(5, 4), torch.randn(5, 4), torch.randn(5, 4)
    expected = -torch.log(torch.sigmoid(((q * p).sum(1) - (q * n).sum(1)) / 0.5)).mean()
    assert bpr_loss(q, p, n, temperature=0.5).item() == pytest.approx(expected.item(), rel=1e-6)
    module, users, items = seeded_mf(dm, normalize=False, loss="bpr", temperature=1.0)
    batch = dm.split("train")[torch.arange(6)]
    torch.manual_seed(3)
    loss = module.loss(batch)
    torch.manual_seed(3)
    negatives = torch.randint(1, 1683, (6,))
    u, i = batch["query"]["user_id"].values(), batch["candidate"]["item_id"].values()
    assert loss.item() == pytest.approx(bpr_loss(users[u], items[i], items[negatives]).item(), rel=1e-6)
    with pytest.raises(ValueError, match=r"loss 'bprr' is not one of 'softmax', 'bpr'"):
        TwoTowerModule(dm.sparse_features, **{**MF, "loss": "bprr"})
    with pytest.raises(ValueError, match=r"loss='bpr'.*item_id only, got candidate_features=\['item_id', 'genres'\]"):
        TwoTowerModule(MovieLensRetrievalDataModule(str(movielens_dir()), download=False).sparse_features, loss="bpr")


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, dm: MovieLensRetrievalDataModule) -> dict[str, Any]:
    """MF trained 40 steps (softmax) in this process with RecBole's protocol, tested, saved."""
    work = tmp_path_factory.mktemp("mf")
    with in_this_process(work):
        L.seed_everything(0)
        model = TwoTowerModule(dm.sparse_features, embedding_dim=16, temperature=0.1, table_lr=0.1, **MF)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=RecShardStrategy(),
            max_steps=40,
            limit_val_batches=0,
            enable_checkpointing=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, dm)
        logged = {k: float(v) for k, v in trainer.test(model, dm, verbose=False)[0].items()}
        trainer.save_checkpoint(work / "ckpt")
    return {"logged": logged, "ckpt": work / "ckpt"}


@pytest.mark.dist
def test_a_fit_logs_recboles_test_metrics_of_its_own_embeddings(fitted, dm: MovieLensRetrievalDataModule) -> None:
    assert sorted(fitted["logged"]) == sorted(KEYS)
    loaded = TwoTowerModule.load_from_checkpoint(fitted["ckpt"]).eval()
    rows = dm.split("test")
    with torch.no_grad():
        users = torch.zeros(944, 16)
        users[rows.user] = loaded.model.query_tower(rows.query(torch.arange(len(rows))))
        items = loaded.model.candidate_tower(rows.candidate(torch.arange(1683)))
    assert fitted["logged"] == pytest.approx(brute_force(dm, users, items, "test"), rel=1e-9, abs=1e-9)
    assert fitted["logged"]["test/hit@10"] > 0.1, "a model that hits something, or the equality is vacuous"
