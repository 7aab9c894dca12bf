"""What restoring the unsharded output order costs, against the step it is part of.

A sharded EmbeddingBagCollection whose plan mixes sharding types returns its pooled columns grouped by type; the
strategy puts them back in the unsharded order with one ``torch.cat`` of column slices (and its backward). Here the
same code (``lightning_rec.testing.OutputReordering``) runs on the bench's model tables (``--size``), sharded by hand
with alternating column-wise / table-wise tables, so the order differs, and a training step of the tables (DMP
forward, ``kt.values()``, a loss, backward with the fused update) is timed with the reordering on and off,
interleaved step by step on the same batches in one process. When the orders already agree the strategy removes
its wrapper after the first step, so that case costs nothing by construction (tests/strategy/test_unsharded.py
checks the wrapper is gone).

    .venv/bin/python benchmarks/output_order.py --size realistic

Prints the medians, the median of the paired per-step differences (steady against this machine's drift) and a
JSON line with the ratio reordered / plain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def measure(size_name: str, steps: int) -> dict:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from lightning_rec.testing import OutputReordering
    from lightning_rec.testing.bench.workload import SIZES, BenchModel, make_batches
    from lightning_rec.testing.reference import reference_dmp

    size = SIZES[size_name]
    model = BenchModel.build(size)
    ebc = model.tables
    names = [c.name for c in ebc.embedding_bag_configs()]
    constraints = {n: {"sharding_types": ["column_wise" if i % 2 == 0 else "table_wise"]} for i, n in enumerate(names)}
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.01})
    holder = torch.nn.Module()
    holder.ebc = ebc
    reordering = OutputReordering(holder)
    dmp = reference_dmp(holder, [sharder], torch.device("cpu"), constraints)
    sharded = dmp.module.ebc
    batches = make_batches(size, 0, 8)

    def timed(batch) -> float:
        start = time.perf_counter()
        out = sharded(batch.sparse_features)
        kt = out.wait() if hasattr(out, "wait") else out
        loss = kt.values().square().mean()
        loss.backward()
        return time.perf_counter() - start

    reordering.install(dmp.module)
    first = sharded(batches[0].sparse_features)
    first = first.wait() if hasattr(first, "wait") else first
    assert first.keys() == reordering.orders["ebc"], "the reordering must be active for this measurement"
    assert reordering.reordered(dmp.module) == ["ebc"]
    on, off = [], []
    for i in range(steps):
        batch = batches[i % len(batches)]
        for variant, out in ((True, on), (False, off)) if i % 2 == 0 else ((False, off), (True, on)):
            reordering.enable(dmp.module, variant)
            out.append(timed(batch))
    med_on, med_off = statistics.median(on), statistics.median(off)
    paired = statistics.median(a - b for a, b in zip(on, off))  # each step's two variants ran back to back
    return {
        "size": size_name,
        "steps": steps,
        "plain_ms": 1000 * med_off,
        "reordered_ms": 1000 * med_on,
        "added_ms": 1000 * paired,
        "ratio": 1 + paired / med_off,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="realistic")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    result = measure(args.size, args.steps)
    dist.destroy_process_group()
    print(
        f"{result['size']}: table step {result['plain_ms']:.2f} ms in the sharded order, {result['reordered_ms']:.2f} ms "
        f"reordered; paired median difference {result['added_ms']:+.3f} ms (x{result['ratio']:.3f})"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
