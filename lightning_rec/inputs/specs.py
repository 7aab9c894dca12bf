"""What each sharded embedding module expects of its ``KeyedJaggedTensor``, read from the unsharded module tree
before sharding (the sharded modules keep their table configs private): its features, their tables and sizes, and
whether it pools with weights. :mod:`lightning_rec.inputs.kjt` checks KJTs against these.

Example::

    specs = input_specs(model)                      # {"ebc": ModuleInputs(path="ebc", features=("user", ...), ...)}
    tables = FeatureTables.of(specs)                # every feature's module, table and rows
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Mapping, Optional, Sequence, Tuple

from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection

from lightning_rec.tables import TABLE_MODULE_TYPES, embedding_modules

__all__ = ["FeatureTable", "FeatureTables", "ModuleInputs", "input_specs"]


@dataclass(frozen=True)
class ModuleInputs:
    """What one sharded embedding module expects of its ``KeyedJaggedTensor``.

    Args:
        path: the module's path in the LightningModule (for messages), e.g. ``"sparse_arch.ebc"``.
        features: its feature names, in the order of its table configs (the order it is given in).
        tables: per feature, the table name and its number of rows.
        weighted: whether its tables pool with per-id weights (``is_weighted``), so the KJT must carry them.

    Example::

        >>> import torch
        >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        >>> ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        ...     name="t_user", embedding_dim=4, num_embeddings=10, feature_names=["user"])], device=torch.device("meta"))
        >>> ModuleInputs.of("ebc", ebc).tables
        {'user': ('t_user', 10)}
    """

    path: str
    features: Tuple[str, ...]
    tables: Mapping[str, Tuple[str, int]]
    weighted: bool = False

    @classmethod
    def of(cls, path: str, module: nn.Module) -> Optional["ModuleInputs"]:
        """The inputs of an ``EmbeddingBagCollection``/``EmbeddingCollection`` (``None`` for other modules,
        e.g. a custom sharder's, whose inputs this package does not know)."""
        if isinstance(module, EmbeddingBagCollection):
            configs, weighted = module.embedding_bag_configs(), bool(module.is_weighted())
        elif isinstance(module, EmbeddingCollection):
            configs, weighted = module.embedding_configs(), False
        else:
            return None
        tables: Dict[str, Tuple[str, int]] = {}
        for config in configs:
            for feature in config.feature_names:
                tables.setdefault(feature, (config.name, int(config.num_embeddings)))
        return cls(path=path, features=tuple(tables), tables=tables, weighted=weighted)

    def describe(self, feature: str) -> str:
        """``"feature 'user' (table 't_user', 60 rows)"``, for messages."""
        table, rows = self.tables[feature]
        return f"feature {feature!r} (table {table!r}, {rows} rows)"


@dataclass(frozen=True)
class FeatureTable:
    """Where one feature's ids go: the module, its table and the table's number of rows."""

    module: str
    table: str
    rows: int


@dataclass(frozen=True)
class FeatureTables:
    """Every feature of every sharded embedding module, for checking a batch before it is known which of its KJTs
    feeds which module (:func:`check_on_host`). A feature name that two modules read from tables of different
    sizes is ``ambiguous``: its ids are left to the door check of the module that gets it.

    Example::

        >>> tables = FeatureTables.of({"ebc": ModuleInputs("ebc", ("user",), {"user": ("t_user", 10)})})
        >>> tables.describe("user")
        "feature 'user' (table 't_user', 10 rows)"
    """

    features: Mapping[str, FeatureTable]
    ambiguous: FrozenSet[str] = frozenset()

    @classmethod
    def of(cls, specs: Mapping[str, ModuleInputs]) -> "FeatureTables":
        """The features of the modules ``specs`` describes (see :func:`input_specs`)."""
        features: Dict[str, FeatureTable] = {}
        ambiguous = set()
        for spec in specs.values():
            for feature, (table, rows) in spec.tables.items():
                seen = features.setdefault(feature, FeatureTable(spec.path, table, rows))
                if seen.rows != rows:
                    ambiguous.add(feature)
        return cls(features, frozenset(ambiguous))

    def label(self, features: Sequence[str]) -> str:
        """``"module 'ebc'"`` (or ``"modules 'a', 'b'"``): who reads ``features``, for messages."""
        modules = list(dict.fromkeys(self.features[f].module for f in features))
        return f"module {modules[0]!r}" if len(modules) == 1 else "modules " + ", ".join(map(repr, modules))

    def describe(self, feature: str) -> str:
        """``"feature 'user' (table 't_user', 60 rows)"``, for messages."""
        entry = self.features[feature]
        return f"feature {feature!r} (table {entry.table!r}, {entry.rows} rows)"


def input_specs(module: nn.Module, module_types: Sequence[type] = TABLE_MODULE_TYPES) -> Dict[str, ModuleInputs]:
    """:class:`ModuleInputs` of every embedding module of ``module`` that will be sharded, by module path (read
    before sharding: the sharded modules keep their table configs private)."""
    specs = {path: ModuleInputs.of(path, m) for path, m in embedding_modules(module, module_types).items()}
    return {path: spec for path, spec in specs.items() if spec is not None}
