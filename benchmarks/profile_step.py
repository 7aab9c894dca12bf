"""Where a benchmark variant's step time goes, in one process: forward / backward / rest per step, the op-level
CPU time under ``torch.profiler``, and (``--cprofile``) the Python functions, to compare ``raw`` and ``recshard``
(see BENCHMARKS.md, "Where the time goes").

    .venv/bin/python benchmarks/profile_step.py raw --size realistic
    .venv/bin/python benchmarks/profile_step.py recshard --size realistic
    .venv/bin/python benchmarks/profile_step.py recshard --size tiny --steps 1000 --cprofile
    .venv/bin/python benchmarks/profile_step.py recshard --size realistic --steps 60 --hooks
    .venv/bin/torchrun --nproc-per-node 2 benchmarks/profile_step.py recshard --size realistic_2proc

Each prints one JSON line: ``phases_ms`` (medians per step: forward, backward, the gaps between them, everything
but forward and backward, the whole cycle), ``ops_ms`` (the 12 ops with the most self CPU time over all steps, with ``all_ops_ms`` their total over
every op) or, with ``--cprofile``, the top functions by cumulative time; with ``--hooks``, ``timeline_ms``: the
median time from each of Lightning's per-step hooks to the next; ``broadcast_ms``: the per-step
``torch.distributed.broadcast`` calls (under torchrun, one line per rank).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from dataclasses import replace

import torch

from lightning_rec.testing.bench import SIZES, workload
from lightning_rec.testing.bench.worker import run_worker
from lightning_rec.testing.ports import rank_env


def _instrument(events: list[tuple[str, float]]) -> None:
    """Time stamps around the model's forward and every ``Tensor.backward`` (the same in every variant)."""
    build = workload.BenchModel.build

    def timed_build(size, plain_tables=False, sparse=False):
        model = build(size, plain_tables, sparse)
        forward = type(model).forward

        def timed_forward(self, batch):
            events.append(("fwd0", time.perf_counter()))
            out = forward(self, batch)
            events.append(("fwd1", time.perf_counter()))
            return out

        type(model).forward = timed_forward
        return model

    workload.BenchModel.build = staticmethod(timed_build)
    backward = torch.Tensor.backward

    def timed_backward(self, *args, **kwargs):
        events.append(("bwd0", time.perf_counter()))
        out = backward(self, *args, **kwargs)
        events.append(("bwd1", time.perf_counter()))
        return out

    torch.Tensor.backward = timed_backward


def _instrument_lightning(events: list[tuple[str, float]]) -> None:
    """Time stamps at Lightning's per-step hooks, the strategy's ``batch_to_device`` and ``RecOptimizer.step``."""
    import lightning as L

    from lightning_rec import RecOptimizer, RecShardStrategy

    mark = lambda name: events.append((name, time.perf_counter()))  # noqa: E731

    class Hooks(L.Callback):
        def on_train_batch_start(self, *args):
            mark("on_train_batch_start")  # noqa: E704

        def on_before_zero_grad(self, *args):
            mark("on_before_zero_grad")  # noqa: E704

        def on_before_backward(self, *args):
            mark("on_before_backward")  # noqa: E704

        def on_after_backward(self, *args):
            mark("on_after_backward")  # noqa: E704

        def on_before_optimizer_step(self, *args):
            mark("on_before_optimizer_step")  # noqa: E704

        def on_train_batch_end(self, *args):
            mark("on_train_batch_end")  # noqa: E704

    trainer = L.Trainer

    def trainer_with_hooks(*args, **kwargs):
        return trainer(*args, **{**kwargs, "callbacks": [*kwargs.get("callbacks", []), Hooks()]})

    L.Trainer = trainer_with_hooks
    to_device = RecShardStrategy.batch_to_device

    def timed_to_device(self, *args, **kwargs):
        mark("batch_to_device")
        return to_device(self, *args, **kwargs)

    RecShardStrategy.batch_to_device = timed_to_device
    step = RecOptimizer.step

    def timed_step(self, closure=None):
        mark("RecOptimizer.step")
        return step(self, closure)

    RecOptimizer.step = timed_step


def _timeline(events: list[tuple[str, float]], skip: int) -> dict[str, float]:
    """Median ms from each stamp to the next (a step starts at ``batch_to_device``)."""
    steps: list[list[tuple[str, float]]] = []
    for name, t in events:
        if name == "batch_to_device":
            steps.append([])
        if steps:
            steps[-1].append((name, t))
    flat = [stamp for step in steps[skip:] for stamp in step]  # includes the end of a step -> the next one's start
    gaps: dict[str, list[float]] = {}
    for (a, ta), (b, tb) in zip(flat, flat[1:]):
        gaps.setdefault(f"{a} -> {b}", []).append(1000 * (tb - ta))
    return {k: round(statistics.median(v), 3) for k, v in gaps.items()}


def _instrument_broadcast(durations: list[float]) -> None:
    """Time every ``torch.distributed.broadcast`` (Lightning broadcasts a SIGTERM flag from rank 0 at every
    training step when there are several ranks; nothing else broadcasts per step)."""
    import torch.distributed as dist

    broadcast = dist.broadcast

    def timed_broadcast(*args, **kwargs):
        start = time.perf_counter()
        out = broadcast(*args, **kwargs)
        durations.append(time.perf_counter() - start)
        return out

    dist.broadcast = timed_broadcast


def _phases(events: list[tuple[str, float]], skip: int) -> dict[str, float]:
    steps: list[dict[str, float]] = []
    for name, t in events:
        if name not in ("fwd0", "fwd1", "bwd0", "bwd1"):
            continue
        if name == "fwd0":
            steps.append({})
        if steps:
            steps[-1].setdefault(name, t)
    steps = [s for s in steps[skip:] if len(s) == 4]
    cycles = [b["fwd0"] - a["fwd0"] for a, b in zip(steps, steps[1:])]
    fwd = [s["fwd1"] - s["fwd0"] for s in steps]
    bwd = [s["bwd1"] - s["bwd0"] for s in steps]
    ms = lambda xs: round(1000 * statistics.median(xs), 3)  # noqa: E731
    between = [s["bwd0"] - s["fwd1"] for s in steps]  # loss handling, closure, zero_grad (Lightning), hooks
    after = [b["fwd0"] - a["bwd1"] for a, b in zip(steps, steps[1:])]  # optimizer step, next batch, hooks
    return {
        "forward": ms(fwd),
        "backward": ms(bwd),
        "fwd_to_bwd": ms(between),
        "bwd_to_next_fwd": ms(after),
        "rest": round(ms(cycles) - ms(fwd) - ms(bwd), 3),
        "cycle": ms(cycles),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=list(workload.VARIANTS))
    parser.add_argument("--size", default="realistic", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cprofile", action="store_true", help="Python functions instead of torch ops")
    parser.add_argument(
        "--hooks", action="store_true", help="recshard variants: time between Lightning's per-step hooks"
    )
    args = parser.parse_args()
    if "RANK" not in os.environ:  # one process; under torchrun, its environment wins
        os.environ.update(rank_env(0, 1, int(os.environ.get("MASTER_PORT", "29571"))))
    world_size = int(os.environ["WORLD_SIZE"])
    size = replace(SIZES[args.size], world_size=world_size, steps=args.steps, warmup=args.warmup)
    events: list[tuple[str, float]] = []
    broadcasts: list[float] = []
    _instrument_broadcast(broadcasts)
    _instrument(events)
    if args.hooks:
        _instrument_lightning(events)
    record: dict[str, object] = {"variant": args.variant, "size": args.size, "steps": args.steps}
    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.runcall(run_worker, args.variant, size, 0.01, False)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
        print(out.getvalue())
    else:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run_worker(args.variant, size, 0.01, bandwidth=False)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        record["ops_ms"] = {e.key: round(e.self_cpu_time_total / 1000, 1) for e in ops[:12]}
        record["all_ops_ms"] = round(sum(e.self_cpu_time_total for e in ops) / 1000, 1)
    record["phases_ms"] = _phases(events, args.warmup)
    record["rank"], record["world_size"] = int(os.environ["RANK"]), world_size
    timed = broadcasts[-args.steps :]
    if timed:
        record["broadcast_ms"] = {
            "calls": len(broadcasts),
            "median": round(1000 * statistics.median(timed), 3),
            "mean": round(1000 * statistics.mean(timed), 3),
        }
    if args.hooks:
        record["timeline_ms"] = _timeline(events, args.warmup)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
