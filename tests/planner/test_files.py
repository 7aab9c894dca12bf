"""lightning_rec._planner.files: a plan file turned back into TorchRec's plan, and checked against a run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lightning_rec._planner.inventory as inventory
from lightning_rec._planner.files import check_plan, read_plan, to_sharding_plan
from lightning_rec._planner.inventory import TableInventory
from lightning_rec._planner.planner import make_plan
from lightning_rec._tables import TABLE_MODULE_TYPES
from tests.planner.tables import Tiny, request


def test_the_file_is_the_plan_it_was_made_from(tmp_path: Path) -> None:
    model = Tiny()
    plan, report = make_plan(model, request(model, device_type="cuda", world_size=4, local_world_size=2))
    report.write_json(tmp_path / "plan.json")
    assert to_sharding_plan(read_plan(tmp_path / "plan.json")) == plan
    with pytest.raises(ValueError, match=r"Me\(plan='.*nope.json'\): no such file"):
        read_plan(tmp_path / "nope.json", owner="Me")


def test_a_plan_for_another_run_is_refused_reading_the_given_inventory(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Tiny()
    _, report = make_plan(model, request(model))
    tables = TableInventory.of(Tiny(rows=50))
    monkeypatch.setattr(inventory, "embedding_modules", lambda *a: pytest.fail("walked the module again"))
    with pytest.raises(ValueError) as caught:
        check_plan(
            report, model, TABLE_MODULE_TYPES, world_size=2, local_world_size=1, device_type="cpu", tables=tables
        )
    message = str(caught.value)
    assert "it puts 2 rank(s) on a host, this run 1" in message
    assert "table 'user' is [100, 8] in the plan, [50, 8] in the model" in message
    assert all(p.device == torch.device("meta") for p in model.parameters())
