"""DeepFM (model zoo, issue 15): construction errors, TorchRec's parts, shapes on unsharded tables, and the shipped
config as the CLI builds it. Its CTR quality on 2 processes is a benchmark (BENCHMARKS.md "Model zoo: CTR quality"),
not a test."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import LightningDataModule, LightningModule
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.modules.deepfm import FactorizationMachine

from lightning_rec.config import EmbeddingOptimizer
from lightning_rec.data import MovieLensDataModule, RecDataset, SparseFeature
from lightning_rec.data.base import Jagged
from lightning_rec.models import DeepFMModule, DeepFMNN, build_deepfm
from lightning_rec.models.deepfm import PairwiseFM
from tests.helpers import zoo_deepfm
from tests.helpers.data import REPO, movielens_dir
from tests.helpers.zoo import check_case

FEATURES = [SparseFeature("user", 10), SparseFeature("genre", 5, multi_hot=True)]
CONFIG = REPO / "examples" / "configs" / "movielens_deepfm.yaml"


def _unshard(model: DeepFMModule) -> DeepFMModule:
    """Materialise the meta tables on CPU (what the strategy does by sharding them), seeded."""
    ebc = model.model.sparse_arch.embedding_bag_collection
    assert all(p.is_meta for p in ebc.parameters()), "tables must stay on meta until the strategy shards them"
    torch.manual_seed(0)
    model.model.sparse_arch.embedding_bag_collection = EmbeddingBagCollection(tables=ebc.embedding_bag_configs())
    return model


def _batch():
    data = RecDataset(
        torch.randn(6, 2),
        torch.tensor([1.0, 0, 1, 0, 1, 0]),
        {"user": torch.arange(6), "genre": Jagged.from_lists([[1], [2, 3], [], [4], [0, 1, 2], [3]])},
    )
    return data[torch.arange(6)]


def test_build_deepfm_rejects_bad_arguments_with_hints() -> None:
    with pytest.raises(ValueError, match=r"at least one sparse feature.*HINT"):
        build_deepfm([], 2)
    with pytest.raises(ValueError, match=r"HINT: got embedding_dim=0"):
        build_deepfm(FEATURES, 2, embedding_dim=0)
    with pytest.raises(ValueError, match=r"one logit.*over_arch_layer_sizes=\[8, 2\].*HINT"):
        build_deepfm(FEATURES, 2, over_arch_layer_sizes=[8, 2])
    with pytest.raises(ValueError, match=r"deep_layer_sizes=\[\].*HINT"):
        build_deepfm(FEATURES, 2, deep_layer_sizes=[])
    with pytest.raises(ValueError, match=r"HINT: got fm='cross'"):
        build_deepfm(FEATURES, 2, fm="cross")  # type: ignore[arg-type]
    mixed = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="t_a", embedding_dim=4, num_embeddings=3, feature_names=["a"]),
            EmbeddingBagConfig(name="t_b", embedding_dim=8, num_embeddings=3, feature_names=["b"]),
        ],
        device=torch.device("meta"),
    )
    with pytest.raises(ValueError, match=r"one embedding_dim.*'t_a': 4, 't_b': 8.*HINT"):
        DeepFMNN(mixed, 2)
    with pytest.raises(ValueError, match=r"HINT: choose one of \['adagrad', 'adam', 'sgd'\]"):
        DeepFMModule(FEATURES, 2, dense_optimizer="lamb")  # type: ignore[arg-type]


def test_pairwise_fm_is_the_sum_of_dot_products_of_all_pairs() -> None:
    torch.manual_seed(0)
    embeddings = [torch.randn(5, 3) for _ in range(4)]
    expected = sum((a * b).sum(dim=1, keepdim=True) for a, b in combinations(embeddings, 2))
    torch.testing.assert_close(PairwiseFM()(embeddings), expected)
    # TorchRec's FactorizationMachine also multiplies different dimensions: not the same number.
    assert not torch.allclose(FactorizationMachine()(embeddings), expected, atol=1e-3)


def test_torchrec_fm_variant_computes_simple_deepfmnn_up_to_its_sigmoid() -> None:
    """With ``fm="torchrec"``, one deep layer and a one-layer over arch, DeepFMNN is TorchRec's SimpleDeepFMNN
    (same weights -> same output) except that it returns the logit where TorchRec applies a sigmoid."""
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t_{f.name}", embedding_dim=4, num_embeddings=f.num_embeddings, feature_names=[f.name])
        for f in FEATURES
    ]
    ebc = EmbeddingBagCollection(tables=tables)
    reference = SimpleDeepFMNN(2, ebc, hidden_layer_size=6, deep_fm_dimension=5)
    ours = DeepFMNN(ebc, 2, dense_arch_hidden_size=6, deep_layer_sizes=[5], over_arch_layer_sizes=[1], fm="torchrec")
    ours.dense_arch.load_state_dict(reference.dense_arch.state_dict())
    deep_linear = ours.inter_arch.deep_fm.dense_module._mlp[0]._linear
    deep_linear.load_state_dict(reference.inter_arch.deep_fm.dense_module[0].state_dict())
    ours.over_arch[1].load_state_dict(reference.over_arch.model[0].state_dict())
    batch = _batch()
    expected = reference(batch.dense_features, batch.sparse_features)
    torch.testing.assert_close(torch.sigmoid(ours(batch.dense_features, batch.sparse_features)), expected)


@pytest.mark.parametrize("fm", ["paper", "torchrec"])
def test_deepfm_module_forward_loss_and_predict_on_unsharded_tables(fm: str) -> None:
    model = _unshard(
        DeepFMModule(
            FEATURES,
            2,
            embedding_dim=4,
            dense_arch_hidden_size=8,
            deep_layer_sizes=[8, 4],
            over_arch_layer_sizes=[4, 1],
            fm=fm,
        )
    )
    batch = _batch()
    logits = model(batch)
    assert logits.shape == (6,)
    loss = model.training_step(batch, 0)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.model.over_arch.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads), "the over arch must be trained"
    predicted = model.predict_step(batch, 0)
    assert set(predicted) == {"probability", "label"}
    torch.testing.assert_close(predicted["probability"], torch.sigmoid(logits))
    assert torch.equal(predicted["label"], batch.labels)


def test_deepfm_module_optimizers() -> None:
    model = DeepFMModule(FEATURES, 2)
    assert model.configure_embedding_optimizer() == EmbeddingOptimizer("rowwise_adagrad", lr=0.05)
    opt = DeepFMModule(
        FEATURES,
        2,
        embedding_optimizer=EmbeddingOptimizer("adagrad", lr=0.2),
        dense_optimizer="adagrad",
        dense_lr=0.01,
        dense_weight_decay=1e-4,
    )
    assert opt.configure_embedding_optimizer() == EmbeddingOptimizer("adagrad", lr=0.2)
    dense = opt.configure_optimizers()
    assert isinstance(dense, torch.optim.Adagrad)
    assert dense.defaults["lr"] == 0.01 and dense.defaults["weight_decay"] == 1e-4


@pytest.mark.dist
def test_trains_like_plain_pytorch_pipelined_and_resharded(tmp_path: Path) -> None:
    check_case(tmp_path, zoo_deepfm)


def test_shipped_config_builds_with_the_cli_parser() -> None:
    """The CLI parses examples/configs/movielens_deepfm.yaml, links the DataModule's features into the model, and
    the model it builds (tables unsharded here) scores a real validation batch."""
    from lightning_rec._cli import RecCLI

    shipped = yaml.safe_load(CONFIG.read_text())
    cli = RecCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        auto_configure_optimizers=False,
        args=["--config", str(CONFIG), f"--data.init_args.data_dir={movielens_dir()}", "--trainer.logger=false"],
    )
    model, dm = cli.model, cli.datamodule
    assert isinstance(model, DeepFMModule) and isinstance(dm, MovieLensDataModule)
    assert shipped["trainer"]["devices"] == 2 and cli.trainer.num_devices == 2
    assert shipped["trainer"]["strategy"]["class_path"] == "lightning_rec.RecShardStrategy"
    assert set(shipped["trainer"]["strategy"]["init_args"]["constraints"]) == {"t_user_id", "t_item_id", "t_zip"}
    assert (dm.val_fraction, dm.test_fraction) == (0.1, 0.1), "the 80/10/10 split RecBole's numbers use"
    for key, value in shipped["model"]["init_args"].items():
        if key != "embedding_optimizer":
            assert model.hparams[key] == value, key
    embedding_optimizer = shipped["model"]["init_args"]["embedding_optimizer"]
    assert model.configure_embedding_optimizer() == EmbeddingOptimizer(**embedding_optimizer)
    tables = model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()
    assert {t.name: t.num_embeddings for t in tables} == {f"t_{f.name}": f.num_embeddings for f in dm.sparse_features}
    dm.setup("fit")
    assert (len(dm.split("train")), len(dm.split("val")), len(dm.split("test"))) == (80_000, 10_000, 10_000)
    batch = next(iter(dm.val_dataloader()))
    probabilities = _unshard(model).predict_step(batch, 0)["probability"]
    assert probabilities.shape == batch.labels.shape
    assert 0 < batch.labels.numel() <= shipped["data"]["init_args"]["batch_size"]
    assert bool(((probabilities > 0) & (probabilities < 1)).all())
