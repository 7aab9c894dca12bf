"""What agreeing on a preemption signal costs a training step: recshard's host-side agreement against Lightning's
per-step SIGTERM broadcast it replaces, on 2 gloo ranks, around a fixed amount of work standing for a step.

Variants, alternated round by round in the same two processes:

* ``none``: the step alone (the work: a small matrix product, about ``--work-ms``);
* ``recshard``: the step, then the strategy's agreement (``lightning_rec.testing.instruments.preemption_agreement``:
  about every 50 ms an async all-reduce of host integers on a gloo group of its own, read at the next one);
* ``lightning``: the step, then what Lightning's loop does after every batch with several ranks: a blocking
  ``broadcast`` of a one-element tensor from rank 0 and ``.item()`` (on a GPU, a device tensor and a host sync).

    .venv/bin/python benchmarks/preemption_agreement.py --steps 2000 --rounds 5

Prints, per variant, the median ms per step over the rounds and the added time against ``none``, and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from lightning_rec.testing.ports import free_port

VARIANTS = ("none", "recshard", "lightning")


def _rank(rank: int, port: int, steps: int, rounds: int, work_ms: float) -> None:
    import torch
    import torch.distributed as dist

    from lightning_rec.testing.instruments import preemption_agreement

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    agreed = preemption_agreement(world_size=2)
    a = torch.randn(64, 64)
    for _ in range(200):  # warm-up
        a @ a
    start = time.perf_counter()
    for _ in range(200):
        a @ a
    reps = max(1, round(work_ms / 1000 / ((time.perf_counter() - start) / 200)))  # about work_ms of work a step
    flag = torch.zeros(1, dtype=torch.int64)

    def step(variant: str) -> None:
        for _ in range(reps):
            a @ a
        if variant == "recshard":
            agreed()
        elif variant == "lightning":
            dist.broadcast(flag, src=0)
            flag.item()

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            dist.barrier()
            begin = time.perf_counter()
            for _ in range(steps):
                step(variant)
            dist.barrier()
            times[variant].append((time.perf_counter() - begin) / steps * 1000)
    dist.barrier()
    if rank == 0:
        medians = {v: statistics.median(t) for v, t in times.items()}
        for v in VARIANTS:
            print(f"{v:10s} {medians[v]:.4f} ms/step  (+{(medians[v] - medians['none']) * 1000:.1f} us)")
        print(
            json.dumps(
                {
                    "ms_per_step": medians,
                    "added_us": {v: (medians[v] - medians["none"]) * 1000 for v in VARIANTS},
                    "steps": steps,
                    "rounds": rounds,
                }
            )
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work-ms", type=float, default=1.0)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        _rank(args.rank, args.port, args.steps, args.rounds, args.work_ms)
        return
    port = free_port()
    base = [sys.executable, __file__, "--steps", str(args.steps), "--rounds", str(args.rounds)]
    base += ["--work-ms", str(args.work_ms), "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    children = [subprocess.Popen([*base, "--rank", str(r)], env=env) for r in (0, 1)]
    sys.exit(max(c.wait() for c in children))


if __name__ == "__main__":
    main()
