"""lightning_rec._planner.fit: why a model does not fit, on meta tables, the bigger topologies' plans stubbed."""

from __future__ import annotations

from torchrec.distributed.planner.types import PlannerError

from lightning_rec._planner.cluster import Cluster
from lightning_rec._planner.constants import MAX_CANDIDATE_PLANS
from lightning_rec._planner.fit import DoesNotFit, does_not_fit
from lightning_rec.config import TableConstraints
from tests.planner.tables import Tiny, request

A100 = Cluster(1, 2, preset="a100-40g", ddr_gb=1)


def _big() -> Tiny:
    return Tiny(rows=40_000_000, dim=128)  # item: 160M x 128 fp32 = 76 GiB


def test_the_tables_that_do_not_fit_are_named_with_what_they_need() -> None:
    model = _big()
    req = request(
        model,
        device_type="cuda",
        preset=A100.device(),
        constraints={"item": TableConstraints(sharding_types=["table_wise"])},
    )

    def plans(cluster: Cluster) -> None:
        raise PlannerError("table-wise: no number of these ranks holds it")

    err = does_not_fit(model, req, A100, plans)
    assert isinstance(err, DoesNotFit) and isinstance(err, ValueError)
    assert list(err.needs)[0] == "item" and err.needs["item"] >= 160_000_000 * 128 * 4
    assert "item (76.3 GiB in its smallest shard) does not fit on any of these ranks" in str(err)
    assert "the planner assumed 512 per rank" in str(err) and err.smallest_fit is None


def test_the_smallest_bigger_topology_that_plans_is_suggested_and_few_are_planned() -> None:
    model = _big()
    req = request(model, device_type="cuda", preset=A100.device())
    tried: list[Cluster] = []

    def plans(cluster: Cluster) -> None:
        tried.append(cluster)
        if cluster.hosts < 16:
            raise PlannerError("no")

    err = does_not_fit(model, req, A100, plans)
    assert err.smallest_fit is not None and err.smallest_fit.hosts == 16 and err.smallest_fit.devices_per_host == 2
    assert "is 16 x 2 a100-40g (32 ranks)" in str(err)
    assert [c.hosts for c in tried] == sorted(c.hosts for c in tried) and len(tried) <= MAX_CANDIDATE_PLANS
    tried.clear()

    def never(cluster: Cluster) -> None:
        tried.append(cluster)
        raise PlannerError("no")

    none = does_not_fit(model, req, A100, never)
    assert (
        none.smallest_fit is None and len(tried) == MAX_CANDIDATE_PLANS and "none of the topologies tried" in str(none)
    )
