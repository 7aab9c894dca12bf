"""The same training runs under every launcher users already have: Lightning's own, torchrun (one host, and two
"hosts" with a c10d rendezvous on 127.0.0.1) and SLURM's srun (its environment, simulated here); the planner sees
the right world size and ranks per host, and the numbers agree."""

from __future__ import annotations

import json
import re

import pytest

from lightning_rec.checkpoint import is_checkpoint
from tests.helpers import scenarios
from tests.helpers.dist import REPO, launch, run_ranks

pytestmark = pytest.mark.dist

STEPS = 6


def _check(results, environment, local_world_size):
    for rank, r in enumerate(results):
        assert r["environment"] == environment
        assert r["planner_topology"] == {"world_size": 2, "local_world_size": local_world_size}
        assert r["node_rank"] == rank // local_world_size and r["local_rank"] == rank % local_world_size
        assert len(r["losses"]) == STEPS


def test_two_hosts_under_torchrun_and_slurm_match_one_host(tmp_path):
    two_hosts = {"nodes": 2, "trainer": {"num_nodes": 2}, "steps": STEPS}
    torchrun = run_ranks(scenarios.train, 2, tmp_path / "torchrun", launcher="torchrun", **two_hosts)
    _check(torchrun, "TorchElasticEnvironment", local_world_size=1)
    slurm = run_ranks(scenarios.train, 2, tmp_path / "slurm", launcher="slurm", **two_hosts)
    _check(slurm, "SLURMEnvironment", local_world_size=1)
    one_host = run_ranks(scenarios.train, 2, tmp_path / "env", steps=STEPS)
    _check(one_host, "LightningEnvironment", local_world_size=2)
    one_host_torchrun = run_ranks(scenarios.train, 2, tmp_path / "torchrun1", launcher="torchrun", steps=STEPS)
    _check(one_host_torchrun, "TorchElasticEnvironment", local_world_size=2)
    for rank in range(2):
        # Same world size, same topology: bit-identical, whichever launcher started the ranks.
        assert slurm[rank]["losses"] == torchrun[rank]["losses"]
        assert one_host_torchrun[rank]["losses"] == one_host[rank]["losses"]
        # Another topology may place tables elsewhere: the same training up to float summation order.
        assert all(abs(a - b) < 1e-5 for a, b in zip(torchrun[rank]["losses"], one_host[rank]["losses"]))


def test_the_quickstart_script_runs_on_two_hosts_under_torchrun(tmp_path):
    """examples/quickstart.py, unchanged, started by two torchrun agents (`--nnodes=2 --nproc-per-node=1`)."""
    script = [
        str(REPO / "examples" / "quickstart.py"),
        "--devices",
        "1",
        "--num-nodes",
        "2",
        "--max-epochs",
        "1",
        "--root-dir",
        str(tmp_path / "run"),
    ]
    run = launch("quickstart", 2, tmp_path, launcher="torchrun", nodes=2, command=script)
    assert [p.returncode for p in run.processes] == [0, 0], run.processes[0].log[-3000:] + run.processes[1].log[-3000:]
    log = run.log("node0") + run.log("node1")
    assert "sharding plan over 2 rank(s), 1 per host" in log
    assert float(re.search(r"final train_loss=([0-9.]+)", log).group(1)) < 0.6  # starts at ~0.69
    ckpt = next((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert is_checkpoint(ckpt) and {p.name.split("_")[2] for p in ckpt.glob("*.distcp")} == {"0", "1"}
    report = json.loads((tmp_path / "run" / "sharding_plan.json").read_text())
    assert (report["world_size"], report["local_world_size"], report["num_hosts"]) == (2, 1, 2)
