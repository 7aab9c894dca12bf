"""What recshard's input checks cost per step, against the training step they protect, in one process.

The bench's A/B of whole runs (``python -m lightning_rec.testing.bench --variants raw,recshard,recshard_unchecked``) has
run-to-run noise of +-10% on this machine, far above the checks' cost; here both are timed in the same process,
interleaved step by step on the same batches: a hand-written TorchRec step (DMP forward, backward, fused update,
dense update) of the bench's model, and the checks recshard runs for it: on the host before the copy (every KJT's
contents, the dense tensors), at the EBC's door (features, dtypes, shapes), and the loss (sent to host memory).

    .venv/bin/python benchmarks/input_checks.py --sizes tiny,realistic
    .venv/bin/python benchmarks/input_checks.py --sizes criteo_onehot,criteo_multihot --host-only

``--host-only`` times the host checks alone (no model: the GPU sizes' 13 GB of tables need not exist), the work the
host must finish per step while the GPU trains. Prints one line per size and a JSON line with the medians.
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

    from lightning_rec.testing import StepInputChecks
    from lightning_rec.testing.bench.workload import SIZES, BenchModel, init_weights, make_batches, table_constraints
    from lightning_rec.testing.reference import reference_dmp, reference_optimizer

    size = SIZES[size_name]
    model = BenchModel.build(size)
    checks = StepInputChecks(model)  # the doors: the model's one EmbeddingBagCollection, "tables"
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.01})
    dmp = reference_dmp(model, [sharder], torch.device("cpu"), table_constraints(size))
    init_weights(dmp.module)
    optimizer = reference_optimizer(dmp, lambda ps: torch.optim.SGD(ps, lr=0.01))
    step_s, check_s = [], []
    for i, batch in enumerate(make_batches(size, 0, size.warmup + steps)):
        t0 = time.perf_counter()
        checks.check_host(batch)
        checks.check_door(batch.sparse_features, "tables")
        t1 = time.perf_counter()
        optimizer.zero_grad()
        loss, _ = dmp(batch)
        t2 = time.perf_counter()
        checks.check_loss(loss)
        t3 = time.perf_counter()
        loss.backward()
        optimizer.step()
        t4 = time.perf_counter()
        if i >= size.warmup:
            check_s.append((t1 - t0) + (t3 - t2))
            step_s.append((t2 - t1) + (t4 - t3))
    assert checks.door_reads == 0, "the door read contents the host had checked"
    step, check = statistics.median(step_s), statistics.median(check_s)
    return {
        "size": size_name,
        "ids_per_step": size.tables * size.batch_size * size.pooling,
        "step_ms": round(1000 * step, 3),
        "checks_ms": round(1000 * check, 4),
        "checks_vs_step": round(check / step, 5),
    }


def measure_host(size_name: str, steps: int) -> dict:
    """The host checks alone (``check_host`` of each batch, as ``batch_to_device`` runs it before the copy)."""
    from lightning_rec.testing import StepInputChecks
    from lightning_rec.testing.bench.workload import SIZES, BenchModel, make_batches

    size = SIZES[size_name]
    checks = StepInputChecks(BenchModel.build(size))  # its tables on meta: their sizes, no memory
    batches = make_batches(
        size, 0, min(size.warmup + steps, 4)
    )  # a few distinct batches, cycled (the GPU sizes' are big)
    times = []
    for i in range(size.warmup + steps):
        t0 = time.perf_counter()
        checks.check_host(batches[i % len(batches)], trust=False)
        if i >= size.warmup:
            times.append(time.perf_counter() - t0)
    ids = size.tables * size.batch_size * size.pooling
    return {
        "size": size_name,
        "ids_per_step": ids,
        "host_checks_ms": round(1000 * statistics.median(times), 3),
        "ns_per_id": round(1e9 * statistics.median(times) / ids, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,realistic")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--host-only", action="store_true", help="time the host checks alone (any size, no model)")
    args = parser.parse_args()
    if args.host_only:
        out = [measure_host(name, 20) for name in args.sizes.split(",")]
        for r in out:
            print(
                f"{r['size']:16s} host checks {r['host_checks_ms']:8.3f} ms for {r['ids_per_step']} ids "
                f"({r['ns_per_id']} ns/id)",
                flush=True,
            )
        print(json.dumps(out))
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("gloo", rank=0, world_size=1)
    out = []
    for name in args.sizes.split(","):
        from lightning_rec.testing.bench.workload import SIZES

        steps = args.steps if SIZES[name].batch_size < 1024 else max(20, args.steps // 10)
        r = measure(name, steps)
        out.append(r)
        print(
            f"{name:10s} step {r['step_ms']:8.2f} ms  checks {r['checks_ms']:7.3f} ms  = {100 * r['checks_vs_step']:.2f}% "
            f"of the step ({r['ids_per_step']} ids)",
            flush=True,
        )
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
