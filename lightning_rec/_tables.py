"""Which submodules of a model hold embedding tables that get sharded: the one place this is decided.

A pure function of the module tree, below the machinery that shards them: the planner, the input checks, the
unsharded view, the pretrained rows and the strategy all ask it. Every TorchRec embedding module that trains is
sharded (:data:`TABLE_MODULE_TYPES`: ``EmbeddingBagCollection``, ``EmbeddingCollection``, the position-weighted
``FeatureProcessedEmbeddingBagCollection`` and the managed-collision ``ManagedCollisionEmbeddingBagCollection`` /
``ManagedCollisionEmbeddingCollection``), plus the module type of any extra sharder given to the strategy; of
nested matches only the outermost is (a managed-collision module's inner ``EmbeddingBagCollection`` is sharded with
it, not apart).

Example::

    >>> import torch
    >>> from torch import nn
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    >>> model = nn.Sequential(EmbeddingBagCollection(tables=[EmbeddingBagConfig(
    ...     name="t_user", embedding_dim=4, num_embeddings=10, feature_names=["user"])], device=torch.device("meta")))
    >>> list(embedding_modules(model)), list(embedding_tables(model))
    (['0'], ['t_user'])
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.types import ModuleSharder, ShardedModule
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import (
    BaseManagedCollisionEmbeddingCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)

from lightning_rec import _compat

__all__ = [
    "TABLE_MODULE_TYPES",
    "dense_parameter_ids",
    "embedding_modules",
    "embedding_tables",
    "inner_collection",
    "is_sharded",
    "sharded_module_types",
    "table_configs",
    "table_weights",
    "tables_of",
    "weights_of",
]

# The module types sharded without any extra sharder (each has a built-in sharder: lightning_rec._planner.sharders).
TABLE_MODULE_TYPES: tuple[type[nn.Module], ...] = (
    EmbeddingBagCollection,
    EmbeddingCollection,
    FeatureProcessedEmbeddingBagCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)


def inner_collection(module: nn.Module) -> EmbeddingBagCollection | EmbeddingCollection | None:
    """The ``EmbeddingBagCollection``/``EmbeddingCollection`` that holds ``module``'s tables: the module itself, the
    one a feature processor or a managed-collision collection sits in front of, or ``None`` (another module).

    Example::

        >>> import torch
        >>> from torchrec import EmbeddingBagConfig
        >>> ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
        ...     feature_names=["f"])], device=torch.device("meta"))
        >>> inner_collection(ebc) is ebc
        True
    """
    if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
        return module
    if isinstance(module, FeatureProcessedEmbeddingBagCollection):
        return module.split()[1]
    if isinstance(module, BaseManagedCollisionEmbeddingCollection):
        return _compat.managed_collision_parts(module)[0]
    return None


def table_configs(module: nn.Module) -> list[BaseEmbeddingConfig]:
    """The table configs of an embedding module (see :func:`inner_collection`); a custom sharder's module is asked
    for ``embedding_bag_configs()`` or ``embedding_configs()``, and has none if it answers to neither."""
    inner: Any = inner_collection(module) or module  # duck-typed: asked for the methods it has
    if isinstance(inner, EmbeddingBagCollection) or (
        not isinstance(inner, EmbeddingCollection) and callable(getattr(inner, "embedding_bag_configs", None))
    ):
        return list(inner.embedding_bag_configs())
    if callable(getattr(inner, "embedding_configs", None)):
        return list(inner.embedding_configs())
    return []


def sharded_module_types(sharders: Sequence[ModuleSharder[nn.Module]] = ()) -> tuple[type[nn.Module], ...]:
    """:data:`TABLE_MODULE_TYPES` plus the ``module_type`` of each extra TorchRec sharder, without repeats."""
    return tuple(dict.fromkeys([*TABLE_MODULE_TYPES, *(s.module_type for s in sharders)]))


def embedding_modules(
    module: nn.Module, module_types: Sequence[type[nn.Module]] = TABLE_MODULE_TYPES
) -> dict[str, nn.Module]:
    """The outermost submodules of ``module`` that are instances of ``module_types``, by module path."""
    found: dict[str, nn.Module] = {}
    types = tuple(module_types)

    def visit(mod: nn.Module, path: str) -> None:
        if isinstance(mod, types):
            found[path] = mod
            return
        for name, child in mod.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(module, "")
    return found


def embedding_tables(
    module: nn.Module, module_types: Sequence[type[nn.Module]] = TABLE_MODULE_TYPES
) -> dict[str, BaseEmbeddingConfig]:
    """Every table of every module :func:`embedding_modules` finds, by table name.

    Raises:
        ValueError: if two modules declare a table of the same name (the plan and checkpoints key by it).
    """
    return tables_of(embedding_modules(module, module_types))


def tables_of(modules: Mapping[str, nn.Module]) -> dict[str, BaseEmbeddingConfig]:
    """:func:`embedding_tables` of the embedding ``modules`` already found (by module path).

    Raises:
        ValueError: if two modules declare a table of the same name (the plan and checkpoints key by it).
    """
    tables: dict[str, BaseEmbeddingConfig] = {}
    owners: dict[str, str] = {}
    for path, sub in modules.items():
        for config in table_configs(sub):
            if config.name in tables:
                raise ValueError(
                    f"Table name {config.name!r} is used by both {owners[config.name]!r} and {path!r}. "
                    "HINT: give every EmbeddingBagConfig/EmbeddingConfig a unique `name`."
                )
            tables[config.name] = config
            owners[config.name] = path
    return tables


def table_weights(
    module: nn.Module, module_types: Sequence[type[nn.Module]] = TABLE_MODULE_TYPES
) -> dict[str, nn.Parameter]:
    """Every unsharded table's weight, by table name (what a param group of ``configure_optimizers`` holds)."""
    return weights_of(embedding_modules(module, module_types).values())


def weights_of(modules: Iterable[nn.Module]) -> dict[str, nn.Parameter]:
    """:func:`table_weights` of the embedding ``modules`` already found."""
    weights: dict[str, nn.Parameter] = {}
    for sub in modules:
        inner = inner_collection(sub)
        holders = (
            inner.embedding_bags if isinstance(inner, EmbeddingBagCollection) else getattr(inner, "embeddings", {})
        )
        weights.update({name: holder.weight for name, holder in holders.items()})
    return weights


def dense_parameter_ids(modules: Iterable[nn.Module]) -> frozenset[int]:
    """The parameters of embedding ``modules`` that are no table's (a feature processor's position weights)."""
    modules = list(modules)
    tables = {id(p) for m in modules for p in (inner_collection(m) or m).parameters()}
    return frozenset(id(p) for m in modules for p in m.parameters() if id(p) not in tables)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds a TorchRec-sharded module (its tables were sharded, e.g. by an earlier ``fit``)."""
    return any(isinstance(sub, ShardedModule) for sub in module.modules())
