"""The house rules the layout promises, checked on the source: user-facing modules never import the strategy's
mechanics, private names of torch, TorchRec and Lightning appear only in ``_compat/``, and user configuration
classes can be admitted into checkpoints. The public/private line itself: ``tests/test_public_api.py``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import lightning_rec
from lightning_rec.checkpoint._safe_io import dumps_meta, load_meta
from lightning_rec.config import checkpoint_safe
from lightning_rec.errors import UnsafeCheckpointError
from tests.helpers.source import imports as _imports

PACKAGE = Path(lightning_rec.__file__).parent
REPO = PACKAGE.parent
# Modules a user writes against: they may import configs, errors, tables, the checkpoint API (loading a module) and
# each other, never the strategy's mechanics.
USER_FACING = [
    "_module.py",
    "_batch.py",
    "callbacks.py",
    "metrics.py",
    "_pretrained.py",
    "config.py",
    "errors.py",
    "_tables.py",
]
USER_FACING_DIRS = ["models", "data", "serving"]
MECHANICS = (
    "lightning_rec._strategy",
    "lightning_rec._planner",
    "lightning_rec._inputs",
    "lightning_rec.testing.bench",
    "lightning_rec.testing",
)


def test_public_api_is_importable_from_the_package_root():
    for name in lightning_rec.__all__:
        assert getattr(lightning_rec, name) is not None, name
    from lightning_rec._strategy.recshard import RecShardStrategy

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
    FBGEMM or Lightning outside ``lightning_rec/_compat/``, in the package, the tests, the bench and the benchmarks."""
    foreign = ("torch", "torchrec", "fbgemm_gpu", "lightning", "lightning_utilities")
    files = [p for d in ("lightning_rec", "tests", "benchmarks") for p in (REPO / d).rglob("*.py")]
    found = []
    for path in files:
        if path.parent.name == "_compat" and path.parent.parent.name == "lightning_rec":
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


def test_a_class_pickled_under_an_old_module_path_loads_when_registered_with_it(tmp_path):
    """``checkpoint_safe(old_paths=...)``: a user who moves a config class keeps the checkpoints written before."""

    @dataclass
    class Tower:
        layers: tuple = (64, 32)

    Tower.__module__, Tower.__qualname__ = "tests_old_home", "Tower"
    import sys
    import types

    old_home = types.ModuleType("tests_old_home")
    old_home.Tower = Tower
    sys.modules["tests_old_home"] = old_home
    try:
        blob = dumps_meta({"tower": Tower()})
    finally:
        del sys.modules["tests_old_home"]
    Tower.__module__ = __name__
    meta = tmp_path / "meta.pt"
    meta.write_bytes(blob)
    with pytest.raises(UnsafeCheckpointError, match="tests_old_home"):
        load_meta(meta)
    checkpoint_safe(Tower, old_paths=["tests_old_home.Tower"])
    loaded = load_meta(meta)["tower"]
    assert loaded == Tower() and type(loaded) is Tower


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
    assert torch.equal(_compat.collision_output_segments(mc)[:3], torch.tensor([0, 8, -1]))

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


def _module_graph() -> dict[str, set[str]]:
    """Each lightning_rec module -> the lightning_rec modules it imports, function-local imports included."""
    root = Path(lightning_rec.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, module, names in _imports(path):
            if not module.startswith("lightning_rec"):
                continue
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules] or [module]
            graph[name].update(t for t in targets if t in modules)
    return graph


def test_no_module_imports_itself_back_through_others():
    """No import cycles, not even ones hidden by function-local imports (issue 37 found data/base <-> data/stream):
    each module's responsibilities sit above or below another's, never both."""
    graph = _module_graph()
    cycles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start and len(path) > 1:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen and nxt != "lightning_rec":  # the package root re-exports; it is not a layer
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, "\n".join(sorted(set(cycles)))
