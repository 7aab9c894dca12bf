"""The house rules the layout promises, checked on the source: old import paths still work (with a deprecation
naming the new one), user-facing modules never import the strategy's mechanics, private names of torch, TorchRec
and Lightning appear only in ``_compat.py``, and user configuration classes can be admitted into checkpoints."""

from __future__ import annotations

import ast
import importlib
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import lightning_rec
from lightning_rec import _moved
from lightning_rec.checkpoint.safe_io import UnsafeCheckpointError, dumps_meta, load_meta
from lightning_rec.config import TableConstraints, checkpoint_safe

PACKAGE = Path(lightning_rec.__file__).parent
REPO = PACKAGE.parent
# Modules a user writes against: they may import configs, errors, tables, the checkpoint API (loading a module) and
# each other, never the strategy's mechanics.
USER_FACING = [
    "module.py",
    "batch.py",
    "callbacks.py",
    "metrics.py",
    "pretrained.py",
    "config.py",
    "errors.py",
    "tables.py",
]
USER_FACING_DIRS = ["models", "data", "serving"]
MECHANICS = ("lightning_rec.strategy", "lightning_rec.inputs", "lightning_rec.bench", "lightning_rec.testing")


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []


@pytest.mark.parametrize("old, new", sorted(_moved.MOVED.items()))
def test_old_module_paths_import_the_new_module_with_a_deprecation(old, new):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)


def test_public_api_is_importable_from_the_package_root():
    for name in lightning_rec.__all__:
        assert getattr(lightning_rec, name) is not None, name
    from lightning_rec.strategy import RecShardStrategy

    assert RecShardStrategy is lightning_rec.RecShardStrategy


def test_user_facing_modules_do_not_import_the_mechanics():
    files = [PACKAGE / f for f in USER_FACING] + [p for d in USER_FACING_DIRS for p in (PACKAGE / d).rglob("*.py")]
    breaks = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in files
        for line, module, _ in _imports(path)
        if module.startswith(MECHANICS)
    ]
    assert not breaks, "\n".join(breaks)


def test_private_names_of_other_packages_appear_only_in_compat():
    """No ``from torch.x._y import ...``/``import torch._z`` and no ``from x import _name`` of torch, TorchRec,
    FBGEMM or Lightning outside ``_compat.py``, in the package, the tests, the bench and the benchmarks."""
    foreign = ("torch", "torchrec", "fbgemm_gpu", "lightning", "lightning_utilities")
    files = [p for d in ("lightning_rec", "tests", "benchmarks") for p in (REPO / d).rglob("*.py")]
    found = []
    for path in files:
        if path.name == "_compat.py":
            continue
        for line, module, names in _imports(path):
            if module.split(".")[0] not in foreign:
                continue
            private_module = any(part.startswith("_") for part in module.split("."))
            private_name = any(n.startswith("_") and not n.startswith("__") for n in names)
            if private_module or private_name:
                found.append(f"{path.relative_to(REPO)}:{line} {module} {names}")
    assert not found, "\n".join(found)


@dataclass
class _TowerConfig:
    layers: tuple = (64, 32)


def test_user_config_class_is_refused_until_registered_then_loads(tmp_path):
    meta = tmp_path / "meta.pt"
    meta.write_bytes(dumps_meta({"hyper_parameters": {"tower": _TowerConfig()}}))
    with pytest.raises(UnsafeCheckpointError, match="checkpoint_safe"):
        load_meta(meta)
    checkpoint_safe(_TowerConfig)
    assert load_meta(meta)["hyper_parameters"]["tower"] == _TowerConfig()


def test_config_pickled_under_its_old_module_path_still_loads(tmp_path):
    """A checkpoint written when ``TableConstraints`` lived in ``lightning_rec.sharding`` names it so."""
    original = TableConstraints.__module__
    TableConstraints.__module__ = "lightning_rec.sharding"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            blob = dumps_meta({"constraints": TableConstraints(sharding_types=["column_wise"])})
    finally:
        TableConstraints.__module__ = original
    assert b"lightning_rec.sharding" in blob
    meta = tmp_path / "meta.pt"
    meta.write_bytes(blob)
    loaded = load_meta(meta)["constraints"]
    assert loaded == TableConstraints(sharding_types=["column_wise"]) and type(loaded) is TableConstraints
    assert pickle.loads(pickle.dumps(loaded)) == loaded and torch.load(meta, weights_only=False) is not None


def test_strategy_plan_report_argument_is_a_deprecated_alias_of_report_plan():
    """``plan_report`` is the report property; the old argument of that name still works, with a deprecation."""
    with pytest.warns(DeprecationWarning, match=r"plan_report=\.\.\.\) is now `report_plan=\.\.\.`"):
        old = lightning_rec.RecShardStrategy(plan_report=False)
    new = lightning_rec.RecShardStrategy(report_plan=False)
    assert old.plan_report is None and new.plan_report is None  # no report before setup, either way


def test_the_torchrec_internals_compat_relies_on_exist_in_the_installed_torchrec():
    """``_compat``'s helpers for managed-collision modules, sharders' fused parameters and per-table optimizers read
    and write TorchRec's private attributes: each must still exist (a TorchRec upgrade that moves one fails here)."""
    import inspect

    import torchrec.distributed.embedding as ec_sharding
    import torchrec.distributed.embeddingbag as ebc_sharding
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    from lightning_rec import _compat

    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8, feature_names=["f"])]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    mc = MCHManagedCollisionModule(
        zch_size=8, device=torch.device("cpu"), eviction_interval=1, eviction_policy=DistanceLFU_EvictionPolicy()
    )
    module = ManagedCollisionEmbeddingBagCollection(ebc, ManagedCollisionCollection({"t": mc}, tables))
    inner, collection, per_table = _compat.managed_collision_parts(module)
    assert inner is ebc and isinstance(collection, ManagedCollisionCollection) and per_table == {"t": mc}

    fused = {"learning_rate": 0.5}
    for sharder in (
        EmbeddingBagCollectionSharder(fused_params={"eps": 1.0}),
        FeatureProcessedEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder(fused_params={"eps": 1.0})),
        ManagedCollisionEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder(fused_params={"eps": 1.0})),
    ):
        assert _compat.sharder_fused_params(sharder) == {"eps": 1.0}
        copy = _compat.with_sharder_fused_params(sharder, fused)
        assert copy.fused_params == fused and sharder.fused_params == {"eps": 1.0}  # the original is left as it was

    # The per-table fused parameters are read from these attributes when TorchRec shards EBCs and ECs.
    for source in (inspect.getsource(ebc_sharding), inspect.getsource(ec_sharding)):
        assert all(f'getattr(param, "{attr}"' in source for attr in _compat._TABLE_OPTIMIZER_ATTRS)
    weight = ebc.embedding_bags["t"].weight
    with _compat.table_fused_params({weight: {"learning_rate": 0.1}}):
        assert weight._optimizer_kwargs == [{"learning_rate": 0.1}] and weight._optimizer_classes == [None]
    assert not hasattr(weight, "_optimizer_kwargs")  # restored
