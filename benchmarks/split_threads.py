"""What the CPU lookup's split does to the rest of the process: FBGEMM's path timed before the split ever ran, the split,
FBGEMM's path again while the split's backward threads are alive, and once they are stopped (issue 38; BENCHMARKS.md,
"Never slower than FBGEMM's path").

One process, ``--threads`` intra-op threads, the bench model (:mod:`lightning_rec.testing.bench.workload`) by hand
(DMP, ``CombinedOptimizer``) at each ``--sizes`` row of :data:`lightning_rec.testing.bench.LOOKUP_SWEEP`; textbook
steps, blocks of ``--steps`` in this order, twice, medians (ms):

* ``fbgemm``: FBGEMM's forward and fused backward, no split thread alive;
* ``split``: recshard's split on every call (its backward on a pool of threads);
* ``fbgemm_beside_threads``: FBGEMM's path again, the split's threads still alive (idle);
* ``fbgemm_after_release``: FBGEMM's path with them stopped (what the lookup does whenever it takes FBGEMM's path).

Until the split's threads were born with one intra-op thread each, each kept OpenMP workers of its own and the third
block ran 1.6-2.4x slower than the first; now the four blocks show what the threads themselves cost (nothing).

    .venv/bin/python benchmarks/split_threads.py --sizes small,medium_wide,realistic

Prints one JSON line per size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_rec.testing import cpu_lookups
from lightning_rec.testing.bench import LOOKUP_SWEEP, workload
from lightning_rec.testing.bench.runner import reexec_with_steady_malloc
from lightning_rec.testing.bench.worker import raw_torchrec
from lightning_rec.testing.ports import rank_env

NEVER = 1 << 62  # a work threshold no call reaches: FBGEMM's path, the lookup installed (its threads left alone)


def measure(name: str, steps: int) -> dict[str, Any]:
    size = next(s for s in LOOKUP_SWEEP if s.name == name)
    data = workload.make_batches(size, 0, 4)
    dmp, optimizer = raw_torchrec(size, 0.01, torch.device("cpu"))
    lookups = cpu_lookups(dmp)
    if not lookups:
        raise SystemExit("one intra-op thread: nothing is split (give --threads 2 or more)")

    def block() -> float:
        times = []
        for i in range(steps):
            start = time.perf_counter()
            optimizer.zero_grad()
            loss, _ = dmp(data[i % len(data)])
            loss.backward()
            optimizer.step()
            times.append(1000 * (time.perf_counter() - start))
        return statistics.median(times[1:])  # the first step of a block warms its path up

    def use(on: bool, min_work: int) -> None:
        for lookup in lookups:
            lookup.enable(on)  # off: FBGEMM's own forward, the split's threads stopped
            lookup.min_work = min_work

    out: dict[str, list[float]] = {}
    for _ in range(2):
        use(False, NEVER)
        out.setdefault("fbgemm", []).append(block())
        use(True, 0)
        out.setdefault("split", []).append(block())
        use(True, NEVER)
        out.setdefault("fbgemm_beside_threads", []).append(block())
        use(False, NEVER)
        out.setdefault("fbgemm_after_release", []).append(block())
    return {
        "size": name,
        "threads": torch.get_num_threads(),
        "ms": {k: [round(v, 2) for v in vs] for k, vs in out.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="small,medium_wide,realistic")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    reexec_with_steady_malloc()
    torch.set_num_threads(args.threads)
    os.environ.update(rank_env(0, 1, int(os.environ.get("MASTER_PORT", "29577"))))
    dist.init_process_group("gloo")
    try:
        for name in args.sizes.split(","):
            print(json.dumps(measure(name, args.steps)), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
