"""A model's tables, taken once: which embedding modules get sharded, their tables' configs and unsharded weights.

The strategy takes one inventory per ``setup`` (``lightning-rec plan`` one per model) and hands it down the planning
path: the fused optimizer's derivation (which parameters are tables', which tables have a param group of their
own), the constraints' and qcomms' checks, the default constraints, the planner's optimizer-state estimate and the
plan file's check all read it instead of walking the module again. Which modules count is decided in
:mod:`lightning_rec._tables`.

Example::

    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    >>> ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t_user", embedding_dim=4, num_embeddings=10,
    ...     feature_names=["user"])], device=torch.device("meta"))
    >>> tables = TableInventory.of(torch.nn.Sequential(ebc))
    >>> list(tables.modules), list(tables.tables), tables.shapes
    (['0'], ['t_user'], {'t_user': [10, 4]})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from lightning_rec._planner.table import table_shapes
from lightning_rec._tables import (
    TABLE_MODULE_TYPES,
    dense_parameter_ids,
    embedding_modules,
    table_configs,
    tables_of,
    weights_of,
)

__all__ = ["TableInventory"]


@dataclass(frozen=True, eq=False)
class TableInventory:
    """The tables of one model as the planner and the strategy see them (the model is walked once, by :meth:`of`).

    Args:
        module_types: the module types that get sharded (see :func:`lightning_rec._tables.sharded_module_types`).
        modules: the outermost embedding modules of those types, by module path.
        tables: every table's config, by table name (names are unique across modules).
        weights: every unsharded table's weight, by table name.
    """

    module_types: tuple[type[nn.Module], ...]
    modules: Mapping[str, nn.Module]
    tables: Mapping[str, BaseEmbeddingConfig]
    weights: Mapping[str, nn.Parameter]

    @classmethod
    def of(cls, module: nn.Module, module_types: Sequence[type[nn.Module]] = TABLE_MODULE_TYPES) -> TableInventory:
        """Walk ``module`` once for its embedding modules of ``module_types``.

        Raises:
            ValueError: if two modules declare a table of the same name (the plan and checkpoints key by it).
        """
        modules = embedding_modules(module, module_types)
        return cls(tuple(module_types), modules, tables_of(modules), weights_of(modules.values()))

    @property
    def shapes(self) -> dict[str, list[int]]:
        """``{table name: [num_embeddings, embedding_dim]}``, as a plan report records them."""
        return table_shapes(self.tables)

    @property
    def placed(self) -> dict[tuple[str, str], BaseEmbeddingConfig]:
        """Every table's config by ``(module path, table name)``, as a plan file places them."""
        return {(path, config.name): config for path, sub in self.modules.items() for config in table_configs(sub)}

    @property
    def dense_ids(self) -> frozenset[int]:
        """The ``id`` of each parameter inside an embedding module that is no table's (a feature processor's position
        weights): trained by the dense optimizer."""
        return dense_parameter_ids(self.modules.values())

    @property
    def table_parameter_ids(self) -> frozenset[int]:
        """The ``id`` of each parameter the fused embedding optimizer owns: every embedding module's, less
        :attr:`dense_ids`."""
        dense = self.dense_ids
        return frozenset(id(p) for m in self.modules.values() for p in m.parameters() if id(p) not in dense)
