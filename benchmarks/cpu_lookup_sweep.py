"""Where recshard's CPU lookup pays, from tiny to large: the default choice against hand-written TorchRec and the sparse
peer, at 1 and 2 threads (issue 38; BENCHMARKS.md, "Never slower than FBGEMM's path").

One process per ``--threads`` value, the bench model (:mod:`lightning_rec.testing.bench.workload`) at every row of
:data:`lightning_rec.testing.bench.LOOKUP_SWEEP` (tables x rows x dim x batch x ids per sample). Per row, after a
warm-up block each (recshard's holds its lookup's whole trial of both paths), the variants take turns in blocks of a
quarter of the timed steps, on the same batches (so that a machine whose speed drifts slows them all alike; blocks,
not single steps, because recshard's trial times its paths call to call), textbook steps (zero_grad, forward,
backward, step), medians, ms:

* ``raw``: TorchRec by hand (DMP over TorchRec's planner, FBGEMM's CPU forward and serial fused backward), the
  split's threads stopped first (as in a process that never split: ``benchmarks/split_threads.py``);
* ``recshard``: the same DMP and tables with recshard's CPU lookup as the strategy installs it (its default choice,
  call by call: :func:`lightning_rec.testing.cpu_lookup_path`, then a trial above the threshold);
  ``path_taken`` says which path its timed steps took;
* ``split``: the same with the split forced on every call (``min_work=0``): what the default would cost if it did
  not choose (with 1 thread nothing is split: not run);
* ``sparse``: ``nn.EmbeddingBag(sparse=True)`` tables and torch's SGD (the sparse peer), the split's threads stopped.

Lightning's own loop, the same for recshard and the plain-Lightning peer, is not in these
(``benchmarks/paired_overhead.py``).

    .venv/bin/python benchmarks/cpu_lookup_sweep.py --threads 1,2

Runs under the bench's ``steady`` malloc settings. Prints one JSON line per row and thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_rec.testing import cpu_lookup_path, cpu_lookups
from lightning_rec.testing.bench import LOOKUP_SWEEP, Size, workload
from lightning_rec.testing.bench.runner import reexec_with_steady_malloc
from lightning_rec.testing.bench.worker import raw_torchrec
from lightning_rec.testing.instruments import TRIAL_CALLS
from lightning_rec.testing.ports import rank_env


def _step(model: Any, optimizer: Any, batch: Any) -> float:
    start = time.perf_counter()
    optimizer.zero_grad()
    loss, _ = model(batch)
    loss.backward()
    optimizer.step()
    return 1000 * (time.perf_counter() - start)


def measure(size: Size, lr: float = 0.01, distinct: int = 4) -> dict[str, Any]:
    """Every variant's median step at ``size`` (ms), the path recshard's default took, the ratios."""
    threads = torch.get_num_threads()
    data = workload.make_batches(size, 0, distinct)
    dmp, opt = raw_torchrec(size, lr, torch.device("cpu"))
    lookups = cpu_lookups(dmp)  # as the strategy installs them: none with one thread
    sparse = workload.BenchModel.build(size, plain_tables=True, sparse=True)
    workload.init_weights(sparse)
    sparse_opt = workload.torch_optimizer(size.optimizer, sparse.parameters(), lr)

    def tbes(on: bool, min_work: int | None = None) -> Callable[[], None]:
        def use() -> None:
            for lookup in lookups:
                lookup.enable(on)
                lookup.min_work = default if min_work is None else min_work

        return use

    default = lookups[0].min_work if lookups else 0
    variants: dict[str, tuple[Callable[[], None], Any, Any]] = {
        "raw": (tbes(False), dmp, opt),
        "recshard": (tbes(True), dmp, opt),
        # Switched off, the lookups stop the split's threads: raw and sparse run as in a process without them.
        "sparse": (tbes(False), sparse, sparse_opt),
    }
    if lookups:
        variants["split"] = (tbes(True, 0), dmp, opt)
    times: dict[str, list[float]] = {v: [] for v in variants}
    paths: set[str] = set()  # the paths recshard's timed steps took
    # Blocks of steps per variant, in turn: recshard's lookup times its paths call to call (PathTrial), so its warm-up
    # block holds the whole trial.
    warmup = {name: size.warmup for name in variants} | {"recshard": max(size.warmup, TRIAL_CALLS)}
    step = 0
    for name, (use, model, optimizer) in variants.items():
        use()
        for _ in range(warmup[name]):
            _step(model, optimizer, data[step % len(data)])
            step += 1
    block = max(1, size.steps // 4)
    for first in range(0, size.steps, block):
        for name, (use, model, optimizer) in variants.items():
            use()
            for i in range(first, min(first + block, size.steps)):
                times[name].append(_step(model, optimizer, data[i % len(data)]))
                if name == "recshard":
                    paths.update(lookup.last or "fbgemm" for lookup in lookups)
    med = {name: round(statistics.median(v), 3) for name, v in times.items()}
    out: dict[str, Any] = {
        "size": size.name,
        "shape": f"{size.tables}x{size.rows}x{size.dim}, batch {size.batch_size}, {size.pooling} ids",
        "threads": threads,
        "work": size.ids_per_step() * size.dim,
        "default_path": cpu_lookup_path(size.ids_per_step(), size.dim, threads),
        "path_taken": "fbgemm (not installed)" if not lookups else "+".join(sorted(paths)),
        "ms": med,
        "recshard_vs_raw": round(med["raw"] / med["recshard"], 3),
        "recshard_added_ms": round(med["recshard"] - med["raw"], 3),
        "recshard_vs_sparse": round(med["sparse"] / med["recshard"], 3),
    }
    if "split" in med:
        out["split_vs_raw"] = round(med["raw"] / med["split"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(s.name for s in LOOKUP_SWEEP))
    parser.add_argument("--threads", default="1,2", help="comma-separated: one process per value, in turn")
    args = parser.parse_args()
    threads = args.threads.split(",")
    if len(threads) > 1:  # a fresh process per thread count: torch's pools are sized once
        for n in threads:
            subprocess.run([sys.executable, __file__, "--sizes", args.sizes, "--threads", n], check=True)
        return
    reexec_with_steady_malloc()
    torch.set_num_threads(int(threads[0]))
    os.environ.update(rank_env(0, 1, int(os.environ.get("MASTER_PORT", "29575"))))
    dist.init_process_group("gloo")
    try:
        for size in LOOKUP_SWEEP:
            if size.name in args.sizes.split(","):
                print(json.dumps(measure(size)), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
