"""``lightning_rec.testing.instruments``: the strategy's mechanisms called by hand (what ``benchmarks/`` times) do
what the strategy does with them, on a model sharded by hand with TorchRec's own sharder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_ranks

pytestmark = pytest.mark.dist  # a process group (one rank, in this process)


def _sharded_bench_model(constraints: dict[str, dict[str, Any]] | None = None):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from lightning_rec.testing.bench.workload import SIZES, BenchModel, make_batches
    from lightning_rec.testing.reference import reference_dmp

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")  # the rank's environment names the rendezvous
    size = SIZES["tiny"]
    torch.manual_seed(0)
    model = BenchModel.build(size)
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
    return model, (lambda: reference_dmp(model, [sharder], torch.device("cpu"), constraints)), make_batches(size, 0, 2)


def output_order(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    from lightning_rec.testing import OutputReordering
    from lightning_rec.testing.bench.workload import SIZES, BenchModel

    names = [c.name for c in BenchModel.build(SIZES["tiny"]).tables.embedding_bag_configs()]
    # Mixed sharding types: TorchRec returns the keys grouped by type, not in the module's order.
    constraints = {n: {"sharding_types": ["column_wise" if i % 2 == 0 else "table_wise"]} for i, n in enumerate(names)}
    model, shard, batches = _sharded_bench_model(constraints)
    reordering = OutputReordering(model)
    dmp = shard()
    reordering.install(dmp.module)

    def keys() -> list[str]:
        return list(dmp.module.tables(batches[0].sparse_features).wait().keys())

    seen = {"installed": keys(), "reordered": reordering.reordered(dmp.module)}
    reordering.enable(dmp.module, False)
    seen["off"], seen["reordered_off"] = keys(), reordering.reordered(dmp.module)
    reordering.enable(dmp.module, True)
    seen["on"] = keys()
    return {**seen, "unsharded": reordering.orders["tables"]}


def test_output_reordering_puts_the_unsharded_order_back_and_switches_off(tmp_path: Path) -> None:
    (seen,) = run_ranks(output_order, 1, tmp_path)
    assert seen["installed"] == seen["on"] == seen["unsharded"] and seen["reordered"] == ["tables"]
    assert sorted(seen["off"]) == sorted(seen["unsharded"]) and seen["off"] != seen["unsharded"]
    assert seen["reordered_off"] == []


def input_checks(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    from lightning_rec.errors import InputError, NonFiniteError
    from lightning_rec.testing import StepInputChecks

    model, _, batches = _sharded_bench_model()
    checks = StepInputChecks(model, nonfinite="strict")
    batch = batches[0]
    checks.check_host(batch)
    checks.check_door(batch.sparse_features, "tables")
    trusted = checks.door_reads
    checks.check_door(batches[1].sparse_features, "tables")  # not checked on the host: the door reads it
    read = checks.door_reads
    values = batch.sparse_features.values().clone()
    values[0] = 10**6  # past every table's rows
    bad = type(batch.sparse_features)(
        keys=batch.sparse_features.keys(), values=values, lengths=batch.sparse_features.lengths()
    )
    errors = {}
    try:
        checks.check_door(bad, "tables")
    except InputError as e:
        errors["id"] = str(e)
    try:
        checks.check_loss(torch.tensor(float("nan")))
    except NonFiniteError as e:
        errors["loss"] = str(e)
    return {"trusted": trusted, "read": read, "modules": checks.modules, "errors": errors}


def test_step_input_checks_are_the_strategys_checks(tmp_path: Path) -> None:
    (seen,) = run_ranks(input_checks, 1, tmp_path)
    assert seen["modules"] == ["tables"]
    assert seen["trusted"] == 0 and seen["read"] == 1, "the door trusts what the host checked, and reads the rest"
    assert "1000000" in seen["errors"]["id"] and any(f"'f{i}'" in seen["errors"]["id"] for i in range(4)), seen[
        "errors"
    ]
    assert "loss" in seen["errors"]["loss"].lower(), seen["errors"]


def cpu_lookup(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    from lightning_rec.testing import cpu_lookups

    torch.set_num_threads(2)  # the run sets one thread per rank; the lookup is for several
    _, shard, batches = _sharded_bench_model()
    dmp = shard()
    lookups = cpu_lookups(dmp, threads=2)
    for lookup in lookups:
        lookup.min_work = 0  # the split on this small batch too (the default leaves it to FBGEMM)
    ours = dmp.module.pooled(batches[0].sparse_features)
    split = all(lookup.last == "fast" for lookup in lookups)
    for lookup in lookups:
        lookup.enable(False)
    fbgemm = dmp.module.pooled(batches[0].sparse_features)
    return {
        "lookups": len(lookups),
        "split": split,
        "equal": all(torch.equal(a, b) for a, b in zip(ours, fbgemm)),
        "nonzero": all(bool(a.abs().sum() > 0) for a in ours),
    }


def test_cpu_lookups_give_fbgemms_outputs_bit_for_bit(tmp_path: Path) -> None:
    (seen,) = run_ranks(cpu_lookup, 1, tmp_path)
    assert seen["lookups"] >= 1 and seen["nonzero"] and seen["split"]
    assert seen["equal"]
