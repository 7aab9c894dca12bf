"""The one multi-process harness: really spawn N ranks (gloo on CPU), each running a scenario, and collect
what each rank reports.

Every rank is a fresh ``python -m tests.helpers.worker`` process with the environment a launcher such as
torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), so Lightning sees processes created
externally and the hand-written TorchRec loops can ``init_process_group("gloo")`` the same way.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, world_size: int, out_dir: Path, timeout: float = 300, **config: Any) -> List[Dict[str, Any]]:
    """Run ``scenario`` (a function in ``tests.helpers.scenarios``) on ``world_size`` processes.

    Returns:
        each rank's result dict, in rank order.

    Raises:
        AssertionError: with every rank's log, if any rank fails or the run exceeds ``timeout`` seconds.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "NODE_RANK": "0",
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            # Each rank works in the test's directory (anything written to the cwd lands there).
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        log = open(out_dir / f"{scenario}.rank{rank}.log", "w")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.worker", scenario, json.dumps(config), str(out_dir)],
                env=env, cwd=out_dir, stdout=log, stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + timeout
    failed = False
    try:
        for p in procs:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                failed |= p.wait(timeout=remaining) != 0
            except subprocess.TimeoutExpired:
                failed = True
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if failed:
        texts = [(out_dir / f"{scenario}.rank{r}.log").read_text()[-6000:] for r in range(world_size)]
        codes = [p.returncode for p in procs]
        raise AssertionError(
            f"scenario {scenario!r} failed on {world_size} ranks (exit codes {codes}):\n"
            + "\n".join(f"----- rank {r} -----\n{t}" for r, t in enumerate(texts))
        )
    return [json.loads((out_dir / f"{scenario}.rank{r}.json").read_text()) for r in range(world_size)]
