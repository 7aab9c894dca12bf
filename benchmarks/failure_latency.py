"""How long the surviving rank of a 2-process CPU job takes to stop after its peer fails, per kind of failure.

Rank 1 fails at training step 6 of a 3-epoch fit (a RuntimeError, SIGKILL, a bad id, or SIGSTOP: a silent hang);
the figure is the wall time from the failure (stamped by the failing rank just before it) to rank 0's exit. It is
printed against the collective timeout the run was given (recshard's default, 5 minutes; the hang runs use
``--hang-timeout``), i.e. against how long rank 0 would wait if nothing told it sooner.

    .venv/bin/python benchmarks/failure_latency.py --repeats 3

Uses the multi-process harness of :mod:`lightning_rec.testing` (ranks started as torchrun would) and its fault
injection; the scenario is the test suite's (``tests.helpers.checkpoint_scenarios``), found from this checkout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from lightning_rec.testing import failure_time
from lightning_rec.testing.launch import launch

REPO = Path(__file__).resolve().parents[1]

SCENARIO = "tests.helpers.checkpoint_scenarios:fit_epochs"
DEFAULT_TIMEOUT_S = 300.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hang-timeout", type=float, default=20.0, help="collective timeout (s) of the hang runs")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="failure_latency_"))
    out = {}
    for how in ("raise", "bad_id", "kill", "hang"):
        latencies = []
        for rep in range(args.repeats):
            d = root / f"{how}{rep}"
            strategy = {"timeout": args.hang_timeout} if how == "hang" else {}
            run = launch(
                SCENARIO,
                2,
                d,
                tag="x",
                epochs=3,
                strategy=strategy,
                fail={"rank": 1, "step": 6, "how": how},
                wait_for=["rank0"],
                timeout=args.hang_timeout + 240,
                pythonpath=[str(REPO)],
            )
            rank0 = run.processes[0]
            assert rank0.returncode not in (0, None), f"{how}: rank 0 did not fail\n{rank0.log[-3000:]}"
            latencies.append(rank0.ended - failure_time(d, 1))
        timeout = args.hang_timeout if how == "hang" else DEFAULT_TIMEOUT_S
        med = statistics.median(latencies)
        out[how] = {
            "seconds": [round(x, 2) for x in latencies],
            "median_s": round(med, 2),
            "vs_timeout": round(med / timeout, 4),
            "timeout_s": timeout,
        }
        print(
            f"{how:7s} rank 0 exited {med:6.2f} s after rank 1 failed (median of {args.repeats}); "
            f"{med / timeout:.3f} x the timeout of {timeout:.0f} s",
            flush=True,
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
