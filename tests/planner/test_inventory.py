"""lightning_rec._planner.inventory: the tables, taken once."""

from __future__ import annotations

import pytest
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

import lightning_rec._planner.inventory as inventory
from lightning_rec._planner.inventory import TableInventory
from tests.planner.tables import META, Tiny, position_weighted


def test_one_walk_gives_modules_tables_weights_and_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    walks = []
    walk = inventory.embedding_modules
    monkeypatch.setattr(inventory, "embedding_modules", lambda *a: walks.append(a) or walk(*a))
    model = Tiny()
    tables = TableInventory.of(model)
    assert len(walks) == 1
    assert list(tables.modules) == ["ebc", "ec"] and list(tables.tables) == ["user", "item", "odd", "hist"]
    assert tables.weights["item"] is model.ebc.embedding_bags["item"].weight
    assert tables.shapes == {"user": [100, 8], "item": [400, 8], "odd": [10, 6], "hist": [100, 8]}
    assert sorted(tables.placed) == [("ebc", "item"), ("ebc", "odd"), ("ebc", "user"), ("ec", "hist")]
    _ = tables.table_parameter_ids, tables.dense_ids, tables.shapes, tables.placed
    assert len(walks) == 1, "what it holds is read from the one walk"


def test_a_feature_processors_weights_are_dense_not_the_tables() -> None:
    model = position_weighted()
    tables = TableInventory.of(model)
    position = {id(p) for n, p in model.named_parameters() if "position" in n}
    assert tables.dense_ids == frozenset(position) and position
    assert tables.table_parameter_ids == frozenset({id(tables.weights["pw"])})


def test_two_tables_of_one_name_are_refused_naming_both_modules() -> None:
    def ebc() -> EmbeddingBagCollection:
        config = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])
        return EmbeddingBagCollection(tables=[config], device=META)

    with pytest.raises(ValueError, match=r"'t' is used by both '0' and '1'.*unique `name`"):
        TableInventory.of(nn.Sequential(ebc(), ebc()))


def test_module_types_decide_what_is_inventoried() -> None:
    assert list(TableInventory.of(Tiny(), [EmbeddingBagCollection]).tables) == ["user", "item", "odd"]
