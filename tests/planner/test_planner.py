"""lightning_rec._planner.planner: one request in, one plan and its report out (here, without a process group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_rec._planner.planner import asking_the_sharders, make_plan
from lightning_rec._planner.topology import DEVICE_PRESETS
from lightning_rec.config import TableConstraints
from tests.planner.tables import Tiny, request


def test_a_request_gives_the_plan_and_a_report_with_the_planners_estimates() -> None:
    model = Tiny()
    req = request(model, constraints={"item": TableConstraints(sharding_types=["table_wise"])}, batch_size=64)
    plan, report = make_plan(model, req)
    assert plan.get_plan_for_module("ebc")["item"].sharding_type == "table_wise"
    assert (report.world_size, report.local_world_size, report.batch_size, report.preset) == (2, 2, 64, None)
    assert report.estimates_available and report.max_memory_bytes > 0
    assert {r.table: r.shape for r in report.tables}["item"] == [400, 8]
    assert all(p.device == torch.device("meta") for p in model.parameters()), "nothing allocated"


def test_a_given_plan_is_used_as_is_after_its_file_is_checked_against_the_request() -> None:
    model = Tiny()
    plan, report = make_plan(model, request(model, preset=DEVICE_PRESETS["cpu"]))
    fixed, given = make_plan(model, request(model, plan=plan, plan_file=report))
    assert fixed is plan and given is report
    _, bare = make_plan(model, request(model, plan=plan))
    assert not bare.estimates_available
    assert [(t.table, t.shape) for t in bare.tables] == [(t.table, t.shape) for t in report.tables]
    with pytest.raises(ValueError, match=r"RecShardStrategy: the given plan does not fit this run: it is for 2 rank"):
        make_plan(model, request(model, world_size=4, plan=plan, plan_file=report))


def test_the_sharders_see_each_tables_own_optimizer_only_while_asked() -> None:
    model = Tiny()
    weight = model.ebc.embedding_bags["user"].weight
    req = dataclasses.replace(
        request(model), table_fused_params={weight: {"learning_rate": 0.5}}, optimizer_states={weight: torch.optim.SGD}
    )
    with asking_the_sharders(req):
        assert weight._optimizer_kwargs == [{"learning_rate": 0.5}]
        assert weight._optimizer_classes == [torch.optim.SGD]
    assert "_optimizer_kwargs" not in weight.__dict__ and "_optimizer_classes" not in weight.__dict__
