"""Unit tests: constraints validation, the planner's inputs and the plan report."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from lightning_rec._planner.devices import supported_sharding_types, validate_constraints
from lightning_rec._planner.planner import make_planner
from lightning_rec._planner.table import format_plan, plan_rows
from lightning_rec._tables import embedding_tables
from lightning_rec.config import TableConstraints
from tests.helpers.models import RecModel, tables


def _tables(with_ec: bool = False):
    model = RecModel(with_ec=with_ec)
    return embedding_tables(model, [EmbeddingBagCollection, EmbeddingCollection])


def test_row_wise_runs_on_cpu_and_what_torchrec_cannot_shard_is_refused_with_the_alternatives():
    for st in ("row_wise", "ROW_WISE", "table_row_wise", "grid_shard"):
        validate_constraints({"t_user": TableConstraints(sharding_types=[st])}, _tables(), "cpu")
    tabs = _tables(with_ec=True)
    with pytest.raises(ValueError) as info:
        validate_constraints({"t_tag": TableConstraints(sharding_types=["TABLE_ROW_WISE"])}, tabs, "cuda")
    msg = str(info.value)
    assert "table 't_tag': sharding type 'table_row_wise' cannot run on CUDA for an EmbeddingCollection table" in msg
    assert "supported there: table_wise, column_wise, row_wise, data_parallel" in msg
    validate_constraints({"t_tag": TableConstraints(sharding_types=["row_wise"])}, tabs, "cpu")


def test_data_parallel_embedding_collection_is_refused_on_cpu():
    tabs = _tables(with_ec=True)
    with pytest.raises(ValueError, match="table 't_tag': sharding type 'data_parallel' cannot run on CPU"):
        validate_constraints({"t_tag": TableConstraints(sharding_types=["data_parallel"])}, tabs, "cpu")
    validate_constraints({"t_genre": TableConstraints(sharding_types=["data_parallel"])}, tabs, "cpu")


def test_every_problem_is_listed():
    bad = {
        "nope": TableConstraints(),
        "t_user": TableConstraints(sharding_types=["data_parallel"], compute_kernels=["fused_uvm"]),
    }
    with pytest.raises(ValueError) as info:
        validate_constraints(bad, _tables(), "cpu")
    msg = str(info.value)
    assert "unknown tables ['nope']" in msg and "'data_parallel'" not in msg and "'fused_uvm'" in msg


def test_tables_are_found_at_any_depth_and_names_must_be_unique():
    model = RecModel(with_ec=True)
    types = [EmbeddingBagCollection, type(model.towers.inner["ec"])]
    assert set(embedding_tables(model, types)) == {"t_user", "t_item", "t_genre", "t_tag"}
    dup = torch.nn.ModuleDict(
        {
            "a": EmbeddingBagCollection(tables(), device=torch.device("meta")),
            "b": EmbeddingBagCollection(tables(), device=torch.device("meta")),
        }
    )
    with pytest.raises(ValueError, match="'t_user' is used by both 'a' and 'b'"):
        embedding_tables(dup, types)


def test_planner_honours_constraints_and_the_report_names_every_table():
    model = RecModel()
    constraints = {
        name: TableConstraints(sharding_types=list(supported_sharding_types("cpu")))
        for name in ("t_user", "t_item", "t_genre")
    }
    constraints["t_user"] = TableConstraints(sharding_types=["column_wise"])
    constraints["t_item"] = TableConstraints(sharding_types=["table_wise"])
    planner = make_planner(world_size=2, device_type="cpu", topology=None, constraints=constraints)
    plan = planner.plan(model, [EmbeddingBagCollectionSharder()])
    rows = {r.table: r for r in plan_rows(plan)}
    assert rows["t_user"].sharding_type == "column_wise" and rows["t_item"].sharding_type == "table_wise"
    assert sum(s[1] for s in rows["t_user"].shard_sizes) == 8  # column shards add up to the table's dim
    text = format_plan(plan, world_size=2)
    assert text.splitlines()[0].split() == ["module", "table", "sharding", "ranks", "kernel", "shards"]
    for name in ("t_user", "t_item", "t_genre"):
        assert name in text
