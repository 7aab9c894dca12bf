"""lightning_rec._planner.devices: what each device trains, and the refusals."""

from __future__ import annotations

import pytest
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

import lightning_rec._planner.inventory as inventory
from lightning_rec._planner.devices import (
    check_managed_collision,
    check_qcomms,
    default_constraints,
    supported_kernels,
    validate_constraints,
    vbe_refusals,
)
from lightning_rec._planner.inventory import TableInventory
from lightning_rec._tables import TABLE_MODULE_TYPES
from lightning_rec.config import QuantizedComms, TableConstraints
from tests.planner.tables import Tiny


def test_constraints_naming_what_the_device_cannot_train_are_refused_all_at_once() -> None:
    tables = TableInventory.of(Tiny()).tables
    bad = {
        "nope": TableConstraints(sharding_types=["table_wise"]),
        "hist": TableConstraints(sharding_types=["data_parallel"]),
        "user": TableConstraints(compute_kernels=["fused_uvm"]),
    }
    with pytest.raises(ValueError) as caught:
        validate_constraints(bad, tables, "cpu")
    message = str(caught.value)
    assert "unknown tables ['nope']" in message and "'hist': sharding type 'data_parallel'" in message
    assert "'user': compute kernel 'fused_uvm' cannot train on CPU" in message
    validate_constraints({"user": TableConstraints(compute_kernels=["fused_uvm"])}, tables, "cuda")
    assert "fused_uvm_caching" in supported_kernels("cuda") and "fused_uvm" not in supported_kernels("cpu")


def test_quantized_comms_that_cannot_run_on_cpu_are_refused() -> None:
    tables = TableInventory.of(Tiny()).tables
    with pytest.raises(ValueError, match="fp8 cannot run on CPU"):
        check_qcomms(QuantizedComms.of("fp8"), tables, {}, "cpu")
    with pytest.raises(ValueError, match=r"int8 cannot run on CPU for EmbeddingCollection tables \['hist'\]"):
        check_qcomms(QuantizedComms.of("int8"), tables, {}, "cpu")
    check_qcomms(QuantizedComms.of("int8"), tables, {}, "cuda")


def test_default_constraints_keep_an_odd_width_table_data_parallel() -> None:
    defaults = default_constraints(TableInventory.of(Tiny()).tables, "cuda")
    assert defaults["odd"].sharding_types == ["data_parallel"] and "row_wise" in defaults["user"].sharding_types


def test_variable_batch_refusals_name_the_module_and_why() -> None:
    plan = ShardingPlan(
        {"ebc": EmbeddingModuleShardingPlan({"user": ParameterSharding("data_parallel", "dense", None)})}
    )
    refusals = vbe_refusals(plan, ["adagrad"], "cpu", world_size=2)
    assert list(refusals) == ["ebc"] and "adagrad" in refusals["ebc"] and "user (data_parallel)" in refusals["ebc"]
    assert vbe_refusals(plan, ["sgd"], "cuda") == {}


def test_the_managed_collision_check_reads_a_given_inventory(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Tiny()
    tables = TableInventory.of(model)
    monkeypatch.setattr(inventory, "embedding_modules", lambda *a: pytest.fail("walked the module again"))
    check_managed_collision(model, TABLE_MODULE_TYPES, {}, world_size=2, device_type="cpu", tables=tables)
