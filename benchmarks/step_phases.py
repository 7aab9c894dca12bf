"""Where a CPU training step goes, phase by phase, for hand-written TorchRec, recshard's CPU lookup and the sparse
peer (``nn.EmbeddingBag(sparse=True)``), against this machine's limits (issue 26; BENCHMARKS.md, "The CPU step
against the sparse peer").

One process, the bench model (:mod:`lightning_rec.testing.bench.workload`) at each ``--sizes``, the same batches for every
variant. Every phase is timed alone, and the variants take turns phase by phase and batch by batch, so that a
machine whose speed drifts slows them all alike (medians over ``--rounds`` x batches):

* ``input_dist``: TorchRec's input distribution (the sharded module's ``input_dist`` and its waits: the KJT
  permutes and the one-rank all-to-all); the peer's ``KeyedJaggedTensor.to_dict()``;
* ``emb_fwd``: the lookup and output distribution, to one pooled tensor per feature;
* ``dense_fwd_bwd``: the MLP forward, loss and backward on the concatenated input;
* ``emb_bwd_update``: the embedding backward and its update (FBGEMM's fused update; the peer's sparse gradient and
  ``SGD.step`` on its tables);
* ``opt_step``: the dense optimizer step;
* ``step``: the whole textbook step (zero_grad, forward, backward, step); ``glue`` is what the phases leave out
  (the concatenations, ``KeyedTensor`` views, the loss, Python).

Variants: ``raw`` (DMP over TorchRec's planner, FBGEMM's CPU forward and serial fused backward, as a TorchRec
user gets it), ``recshard_kernels`` (the same DMP, tables and weights, with recshard's CPU lookup taking its split
on every call, :func:`lightning_rec.testing.cpu_lookups`), ``sparse_peer``. Switching the lookup off stops its split's threads, so
the others run as in a process without them, and recshard's phases pay for starting them again at each batch. What Lightning's loop adds is measured by
``benchmarks/paired_overhead.py``.

Limits (``limits`` in the output): ``copy_gb_s``, the best ``Tensor.copy_`` bandwidth of a 256 MiB buffer (read +
write); ``gemm_gflops``, the best rate of the MLP's first-layer GEMM at this batch; the embedding traffic
``ids x dim x 4 B x 3`` (forward read, backward read + write) and the dense FLOPs (``6 x batch x weights``: forward,
and the two backward GEMMs); ``bound_ms`` = traffic / copy bandwidth + FLOPs / GEMM rate, the least a step can
take here; every variant's step as a multiple of it (``x_bound``).

    .venv/bin/python benchmarks/step_phases.py --sizes realistic,large

Runs under the bench's ``steady`` malloc settings (re-executing itself with them unless set). Prints one JSON line
per size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_rec.testing import cpu_lookups
from lightning_rec.testing.bench import SIZES, Size, workload
from lightning_rec.testing.bench.runner import reexec_with_steady_malloc
from lightning_rec.testing.bench.worker import copy_bandwidth, raw_torchrec
from lightning_rec.testing.ports import rank_env

PHASES = ("input_dist", "emb_fwd", "dense_fwd_bwd", "emb_bwd_update", "opt_step", "step")


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return 1000 * (time.perf_counter() - start), out


def _textbook_step(model, optimizer, batch) -> float:
    """ms of one zero_grad, forward, backward, step."""

    def run() -> None:
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()

    return _timed(run)[0]


class _TorchRec:
    """The DMP-sharded bench model; ``fast`` switches its TBEs between FBGEMM's forward and recshard's lookup (same
    weights: the two paths give the same bits)."""

    def __init__(self, size: Size, lr: float) -> None:
        self.dmp, self.opt = raw_torchrec(size, lr, torch.device("cpu"))
        self.lookups = cpu_lookups(self.dmp)
        assert self.lookups, "the CPU lookup needs more than one thread"
        self.model = self.dmp.module
        self.dense_opt = torch.optim.SGD(self.model.mlp.parameters(), lr=lr)

    def use(self, fast: bool) -> None:
        for lookup in self.lookups:
            lookup.enable(fast)
            lookup.min_work = 0  # the split on every call: a trial of both paths would time phases of either

    def phases(self, batch, features: list[str]) -> dict[str, float]:
        ebc = self.model.tables
        kjt = batch.sparse_features
        ctx = ebc.create_context()
        t_in, dist_input = _timed(lambda: ebc.input_dist(ctx, kjt).wait().wait())
        t_fwd, pooled = _timed(lambda: ebc.compute_and_output_dist(ctx, dist_input).wait().to_dict())
        outs = [pooled[f] for f in features]
        grads = [torch.ones_like(o) / o.numel() for o in outs]
        t_bwd, _ = _timed(lambda: torch.autograd.backward(outs, grads))
        return {"input_dist": t_in, "emb_fwd": t_fwd, "emb_bwd_update": t_bwd}

    def step(self, batch) -> float:
        return _textbook_step(self.dmp, self.opt, batch)


class _Sparse:
    """The sparse peer: ``nn.EmbeddingBag(sparse=True)`` tables, torch's optimizer for everything."""

    def __init__(self, size: Size, lr: float) -> None:
        self.model = workload.BenchModel.build(size, plain_tables=True, sparse=True)
        workload.init_weights(self.model)
        self.opt = workload.torch_optimizer(size.optimizer, self.model.parameters(), lr)
        self.table_opt = workload.torch_optimizer(size.optimizer, self.model.tables.parameters(), lr)
        self.dense_opt = torch.optim.SGD(self.model.mlp.parameters(), lr=lr)

    def phases(self, batch, features: list[str]) -> dict[str, float]:
        self.opt.zero_grad()  # the last step's gradients would be accumulated into
        t_in, jts = _timed(lambda: batch.sparse_features.to_dict())
        t_fwd, outs = _timed(lambda: [self.model.tables[f](jts[f].values(), jts[f].offsets()) for f in features])
        grads = [torch.ones_like(o) / o.numel() for o in outs]

        def update() -> None:
            torch.autograd.backward(outs, grads)
            self.table_opt.step()
            self.table_opt.zero_grad()

        t_bwd, _ = _timed(update)
        return {"input_dist": t_in, "emb_fwd": t_fwd, "emb_bwd_update": t_bwd}

    def step(self, batch) -> float:
        return _textbook_step(self.model, self.opt, batch)


def _dense_phases(mlp, dense_opt, x: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    x = x.detach().requires_grad_()
    dense_opt.zero_grad()

    def fwd_bwd() -> None:
        F.binary_cross_entropy_with_logits(mlp(x).squeeze(1), labels).backward()

    t_dense, _ = _timed(fwd_bwd)
    t_opt, _ = _timed(dense_opt.step)
    dense_opt.zero_grad()
    return {"dense_fwd_bwd": t_dense, "opt_step": t_opt}


def gemm_gflops(size: Size, repeats: int = 10) -> float:
    """The best GFLOP/s of the MLP's first-layer GEMM (``[batch, tables x dim + dense] x [.., 256]``)."""
    a = torch.randn(size.batch_size, size.tables * size.dim + size.dense)
    b = torch.randn(a.shape[1], 256)
    a @ b
    best = min(_timed(lambda: a @ b)[0] for _ in range(repeats))
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / (best / 1000) / 1e9


def limits(size: Size) -> dict[str, float]:
    """This machine's copy bandwidth and GEMM rate, the step's embedding traffic and dense FLOPs, its lower bound."""
    weights = (size.tables * size.dim + size.dense) * 256 + 256 * 64 + 64
    emb_bytes = size.ids_per_step() * size.dim * 4 * 3
    flops = 6 * size.batch_size * weights
    copy_gb_s, gflops = copy_bandwidth(torch.device("cpu")), gemm_gflops(size)
    return {
        "copy_gb_s": round(copy_gb_s, 2),
        "gemm_gflops": round(gflops, 1),
        "emb_bytes": emb_bytes,
        "dense_flops": flops,
        "emb_bound_ms": round(emb_bytes / copy_gb_s / 1e6, 3),
        "dense_bound_ms": round(flops / gflops / 1e6, 3),
        "bound_ms": round(emb_bytes / copy_gb_s / 1e6 + flops / gflops / 1e6, 3),
    }


def measure(size: Size, rounds: int, batches: int, lr: float = 0.01) -> dict[str, Any]:
    """The phases of every variant at ``size`` (medians, ms), the limits and each step's multiple of the bound."""
    data = workload.make_batches(size, 0, batches)
    features = [f"f{i}" for i in range(size.tables)]
    trec, sparse = _TorchRec(size, lr), _Sparse(size, lr)
    variants: dict[str, Any] = {"raw": (trec, False), "recshard_kernels": (trec, True), "sparse_peer": (sparse, None)}
    times: dict[str, dict[str, list[float]]] = {v: {p: [] for p in PHASES} for v in variants}
    for r in range(rounds + 1):  # round 0 warms up
        for batch in data:
            for name, (impl, fast) in variants.items():
                if fast is not None:
                    impl.use(fast)
                got = impl.phases(batch, features)
                pooled = torch.cat([torch.zeros(size.batch_size, size.tables * size.dim), batch.dense_features], 1)
                got.update(_dense_phases(impl.model.mlp, impl.dense_opt, pooled, batch.labels))
                got["step"] = impl.step(batch)
                if r:
                    for phase, ms in got.items():
                        times[name][phase].append(ms)
    out: dict[str, Any] = {"size": size.name, "rounds": rounds, "batches": batches, "threads": torch.get_num_threads()}
    lim = limits(size)
    for name, phases in times.items():
        med = {p: round(statistics.median(v), 3) for p, v in phases.items()}
        med["glue"] = round(med["step"] - sum(med[p] for p in PHASES if p != "step"), 3)
        med["x_bound"] = round(med["step"] / lim["bound_ms"], 2)
        out[name] = med
    out["limits"] = lim
    out["recshard_kernels_vs_sparse_peer"] = round(out["sparse_peer"]["step"] / out["recshard_kernels"]["step"], 3)
    out["recshard_kernels_vs_raw"] = round(out["raw"]["step"] / out["recshard_kernels"]["step"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="realistic,large")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=8)
    args = parser.parse_args()
    reexec_with_steady_malloc()
    os.environ.update(rank_env(0, 1, int(os.environ.get("MASTER_PORT", "29574"))))
    dist.init_process_group("gloo")
    try:
        for name in args.sizes.split(","):
            print(json.dumps(measure(SIZES[name], args.rounds, args.batches)), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
