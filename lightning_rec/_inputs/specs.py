"""What each sharded embedding module expects of its ``KeyedJaggedTensor``, read from the unsharded module tree
before sharding (the sharded modules keep their table configs private): its features, their tables and sizes, and
whether it pools with weights. :mod:`lightning_rec._inputs.kjt` checks KJTs against these.

Example::

    specs = input_specs(model)                      # {"ebc": ModuleInputs(path="ebc", features=("user", ...), ...)}
    tables = FeatureTables.of(specs)                # every feature's module, table and rows
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

from lightning_rec import _compat
from lightning_rec._tables import TABLE_MODULE_TYPES, embedding_modules, inner_collection, table_configs

__all__ = ["FeatureTable", "FeatureTables", "ModuleInputs", "input_specs"]


@dataclass(frozen=True)
class ModuleInputs:
    """What one sharded embedding module expects of its ``KeyedJaggedTensor``.

    Args:
        path: the module's path in the LightningModule (for messages), e.g. ``"sparse_arch.ebc"``.
        features: its feature names, in the order of its table configs (the order it is given in).
        tables: per feature, the table name and the ids it takes: its number of rows, or for a managed-collision
            module (``raw_ids``) the size of the raw id space (``input_hash_size``) its collision module remaps.
        weighted: whether its tables pool with per-id weights (``is_weighted``), so the KJT must carry them;
            ``None``: it may carry them or not (a feature-processed module makes its own weights).
        raw_ids: the module takes raw ids and remaps them to rows itself (managed collision).

    Example::

        >>> import torch
        >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        >>> ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        ...     name="t_user", embedding_dim=4, num_embeddings=10, feature_names=["user"])], device=torch.device("meta"))
        >>> ModuleInputs.of("ebc", ebc).tables
        {'user': ('t_user', 10)}
    """

    path: str
    features: tuple[str, ...]
    tables: Mapping[str, tuple[str, int]]
    weighted: bool | None = False
    raw_ids: bool = False

    @classmethod
    def of(cls, path: str, module: nn.Module) -> ModuleInputs | None:
        """The inputs of a TorchRec embedding module (see :data:`lightning_rec._tables.TABLE_MODULE_TYPES`; ``None``
        for other modules, e.g. a custom sharder's, whose inputs this package does not know)."""
        inner = inner_collection(module)
        if inner is None:
            return None
        sizes = {config.name: int(config.num_embeddings) for config in table_configs(module)}
        weighted: bool | None = isinstance(inner, EmbeddingBagCollection) and bool(inner.is_weighted())
        raw_ids = isinstance(module, BaseManagedCollisionEmbeddingCollection)
        if isinstance(module, FeatureProcessedEmbeddingBagCollection):
            weighted = None  # its feature processors compute the weights its tables pool with
        elif raw_ids:  # ids are remapped into the table by the module: bounded by the space it remaps from
            sizes = {table: int(mc.input_size()) for table, mc in _compat.managed_collision_parts(module)[2].items()}
        tables: dict[str, tuple[str, int]] = {}
        for config in table_configs(module):
            for feature in config.feature_names:
                tables.setdefault(feature, (config.name, sizes[config.name]))
        return cls(path=path, features=tuple(tables), tables=tables, weighted=weighted, raw_ids=raw_ids)

    def describe(self, feature: str) -> str:
        """``"feature 'user' (table 't_user', 60 rows)"``, for messages (a managed-collision table's raw ids:
        ``"feature 'user' (table 't_user', raw ids below input_hash_size 1024)"``)."""
        table, rows = self.tables[feature]
        return _describe(feature, table, rows, self.raw_ids)


@dataclass(frozen=True)
class FeatureTable:
    """Where one feature's ids go: the module, its table and the table's number of rows (``raw``: the size of the
    raw id space a managed-collision module remaps into the table)."""

    module: str
    table: str
    rows: int
    raw: bool = False


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
    ambiguous: frozenset[str] = frozenset()

    @classmethod
    def of(cls, specs: Mapping[str, ModuleInputs]) -> FeatureTables:
        """The features of the modules ``specs`` describes (see :func:`input_specs`)."""
        features: dict[str, FeatureTable] = {}
        ambiguous = set()
        for spec in specs.values():
            for feature, (table, rows) in spec.tables.items():
                seen = features.setdefault(feature, FeatureTable(spec.path, table, rows, spec.raw_ids))
                if seen.rows != rows or seen.raw != spec.raw_ids:
                    ambiguous.add(feature)
        return cls(features, frozenset(ambiguous))

    def label(self, features: Sequence[str]) -> str:
        """``"module 'ebc'"`` (or ``"modules 'a', 'b'"``): who reads ``features``, for messages."""
        modules = list(dict.fromkeys(self.features[f].module for f in features))
        return f"module {modules[0]!r}" if len(modules) == 1 else "modules " + ", ".join(map(repr, modules))

    def describe(self, feature: str) -> str:
        """``"feature 'user' (table 't_user', 60 rows)"``, for messages."""
        entry = self.features[feature]
        return _describe(feature, entry.table, entry.rows, entry.raw)


def _describe(feature: str, table: str, rows: int, raw: bool) -> str:
    if raw:
        return f"feature {feature!r} (table {table!r}, managed collision: raw ids below input_hash_size {rows})"
    return f"feature {feature!r} (table {table!r}, {rows} rows)"


def input_specs(module: nn.Module, module_types: Sequence[type] = TABLE_MODULE_TYPES) -> dict[str, ModuleInputs]:
    """:class:`ModuleInputs` of every embedding module of ``module`` that will be sharded, by module path (read
    before sharding: the sharded modules keep their table configs private)."""
    specs = {path: ModuleInputs.of(path, m) for path, m in embedding_modules(module, module_types).items()}
    return {path: spec for path, spec in specs.items() if spec is not None}
