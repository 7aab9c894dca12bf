"""The embedding kernels alone, on the same ids: FBGEMM's fused CPU TBE, recshard's CPU lookup over the same TBE, and
torch's ``embedding_bag`` with a sparse gradient and ``SGD.step`` (the sparse peer's tables), at 1 and 2 threads
(issue 26; BENCHMARKS.md, "The CPU step against the sparse peer").

Per ``--size`` of :mod:`lightning_rec.testing.bench` (its tables, batch and ids per sample), medians over ``--repeats``
calls, one kernel after the other (the split's threads alive for recshard's only), ms:

* ``fwd``: the pooled output ``[batch, tables x dim]``;
* ``bwd_update``: the backward of that output (a fixed gradient) and the update of the rows (FBGEMM's fused
  ``EXACT_SGD``; for torch, its backward into a sparse gradient and ``torch.optim.SGD.step``).

    .venv/bin/python benchmarks/cpu_kernels.py --sizes realistic,large

Runs under the bench's ``steady`` malloc settings. Prints one JSON line per size and thread count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from lightning_rec.testing import cpu_lookup
from lightning_rec.testing.bench import SIZES, Size
from lightning_rec.testing.bench.runner import reexec_with_steady_malloc


def _tbe(size: Size, lr: float) -> SplitTableBatchedEmbeddingBagsCodegen:
    spec = (size.rows, size.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
    return SplitTableBatchedEmbeddingBagsCodegen(
        [spec] * size.tables, optimizer=EmbOptimType.EXACT_SGD, learning_rate=lr
    )


def measure(size: Size, threads: int, repeats: int, lr: float = 0.01) -> dict[str, object]:
    """``{"fwd": {kernel: ms}, "bwd_update": {kernel: ms}}`` at ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    n = size.ids_per_step()
    ids = torch.randint(0, size.rows, (n,), generator=g)
    offsets = torch.arange(0, n + 1, size.pooling)
    grad = torch.randn(size.batch_size, size.tables * size.dim, generator=g)
    fbgemm, ours = _tbe(size, lr), _tbe(size, lr)
    lookup = cpu_lookup(ours, threads=threads, min_work=0)  # the split on every call
    tables = [torch.nn.Parameter(w.detach().clone()) for w in fbgemm.split_embedding_weights()]
    sgd = torch.optim.SGD(tables, lr=lr)
    per_table = ids.view(size.tables, -1)
    bag_offsets = torch.arange(0, size.batch_size * size.pooling + 1, size.pooling)

    def torch_pooled() -> list[torch.Tensor]:
        return [
            F.embedding_bag(per_table[t], w, bag_offsets, mode="sum", include_last_offset=True, sparse=True)
            for t, w in enumerate(tables)
        ]

    grads = list(grad.split(size.dim, dim=1))
    kernels: dict[str, dict[str, Callable[[], object]]] = {
        "fwd": {
            "fbgemm": lambda: fbgemm(ids, offsets).detach(),
            "recshard": lambda: ours(ids, offsets).detach(),
            "torch": lambda: [t.detach() for t in torch_pooled()],
        },
    }
    outs: dict[str, object] = {}

    def bwd(name: str) -> Callable[[], None]:
        def run() -> None:
            out = outs.pop(name)
            if name == "torch":
                torch.autograd.backward(out, grads)  # type: ignore[arg-type]
                sgd.step()
                sgd.zero_grad()
            else:
                out.backward(grad)  # type: ignore[union-attr]

        return run

    def prepare(name: str) -> None:
        outs[name] = {
            "fbgemm": lambda: fbgemm(ids, offsets),
            "recshard": lambda: ours(ids, offsets),
            "torch": torch_pooled,
        }[name]()

    times: dict[str, dict[str, list[float]]] = {"fwd": {}, "bwd_update": {}}
    # One kernel after the other, not in turns, the others with the split's threads stopped (the lookup switched off):
    # as in a process that never split (until issue 38's fix its threads slowed every OpenMP region of the process).
    for name in ("fbgemm", "recshard", "torch"):
        lookup.enable(name == "recshard")
        for r in range(repeats + 1):  # the first round warms up
            start = time.perf_counter()
            kernels["fwd"][name]()
            fwd = time.perf_counter() - start
            prepare(name)
            run = bwd(name)
            start = time.perf_counter()
            run()
            upd = time.perf_counter() - start
            if r:
                times["fwd"].setdefault(name, []).append(1000 * fwd)
                times["bwd_update"].setdefault(name, []).append(1000 * upd)
    return {
        "size": size.name,
        "threads": threads,
        "ids": n,
        **{phase: {k: round(statistics.median(v), 3) for k, v in per.items()} for phase, per in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="realistic,large")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    reexec_with_steady_malloc()
    for name in args.sizes.split(","):
        for threads in map(int, args.threads.split(",")):
            print(json.dumps(measure(SIZES[name], threads, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
