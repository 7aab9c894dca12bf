"""Kubernetes' operators on loopback (issue 46, item 4): the PyTorchJob and TrainJob manifests of the docs
(``examples/kubernetes/*.yaml``, shown in docs/scaling-out.md) read here, and each pod started as a process with the
command of its container and the environment its operator gives it (Kubeflow's training-operator for a PyTorchJob:
``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` and torchrun's ``PET_*``; Kubeflow Trainer for a TrainJob:
``PET_*`` only), the master's service name and port replaced by 127.0.0.1 and a free port. Both jobs are 2 pods x 1
process and run the same command, so they must end with the same weights: the TrainJob runs uninterrupted, the
PyTorchJob gets what Kubernetes does to a preempted pod (SIGTERM to its container's first process, ``torchrun``,
mid-epoch), must save and exit non-zero within the pod's grace period (the manifest's
``terminationGracePeriodSeconds``), and its pods, restarted with the same command (``--ckpt_path=last``), must
resume to the TrainJob's final weights.

tests/strategy/test_preemption.py holds the SIGTERM contract for ranks signalled directly; here the signal goes
through torchrun, as in a pod.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_rec.checkpoint import is_checkpoint
from lightning_rec.testing import free_port
from tests.helpers.cluster_jobs import assert_same_weights, small_run, user_env, wait_for, weights
from tests.helpers.dist import REPO

pytestmark = pytest.mark.dist

MANIFESTS = REPO / "examples" / "kubernetes"
STEPS, BATCH, EVERY = 120, 64, 40  # per rank; a checkpoint every EVERY steps (the first: mid-epoch)
ARGS = small_run(STEPS, BATCH, EVERY)
FINAL = f"epoch=0-step={STEPS}.ckpt"
LOOPBACK = "127.0.0.1"
DEFAULT_GRACE = 30  # Kubernetes' terminationGracePeriodSeconds when a pod's spec does not set it


@dataclass
class Pod:
    """One pod as its operator makes it: a name, its container's command and the environment set for it."""

    name: str
    command: list[str]
    env: dict[str, str]
    grace: int


def _command(container: dict[str, Any], runs: Path) -> list[str]:
    """The container's command and args, its shared volume (``/runs``) in ``runs``, made small (:data:`ARGS`)."""
    words = [*container.get("command", []), *container.get("args", [])]
    return [word.replace("/runs/", f"{runs}/") for word in words] + ARGS


def pytorchjob_pods(manifest: dict[str, Any], runs: Path, port: int) -> list[Pod]:
    """The pods Kubeflow's training-operator makes of a PyTorchJob (kubeflow.org/v1; its
    ``pkg/controller.v1/pytorch/envvar.go`` and ``master.go``): Master 0 is rank 0, Worker i rank i + 1; every
    pod gets the master's service (``<job>-master-0``) and the port named ``pytorchjob-port`` as ``MASTER_ADDR``/
    ``MASTER_PORT`` and ``PET_MASTER_ADDR``/``PET_MASTER_PORT``, ``WORLD_SIZE`` = pods x nprocPerNode, ``RANK`` and
    ``PET_NODE_RANK`` = its rank, ``PET_NPROC_PER_NODE``, ``PET_NNODES`` = pods. On loopback the service is
    127.0.0.1 and the port ``port``."""
    name, spec = manifest["metadata"]["name"], manifest["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    nproc = spec.get("nprocPerNode", "1")
    nodes = sum(r["replicas"] for r in replicas.values())
    master = next(c for c in replicas["Master"]["template"]["spec"]["containers"] if c["name"] == "pytorch")
    assert any(p["name"] == "pytorchjob-port" for p in master["ports"]), "the operator needs the master's port"
    pods = []
    for kind in ("Master", "Worker"):
        template = replicas[kind]["template"]["spec"]
        container = next(c for c in template["containers"] if c["name"] == "pytorch")
        for index in range(replicas[kind]["replicas"]):
            rank = index + (kind == "Worker")
            env = {
                **{e["name"]: str(e["value"]) for e in container.get("env", [])},
                "PYTHONUNBUFFERED": "0",
                "MASTER_ADDR": LOOPBACK,
                "MASTER_PORT": str(port),
                "PET_MASTER_ADDR": LOOPBACK,
                "PET_MASTER_PORT": str(port),
                "WORLD_SIZE": str(nodes * int(nproc)),
                "RANK": str(rank),
                "PET_NPROC_PER_NODE": str(nproc),
                "PET_NODE_RANK": str(rank),
                "PET_NNODES": str(nodes),
            }
            grace = template.get("terminationGracePeriodSeconds", DEFAULT_GRACE)
            pods.append(Pod(f"{name}-{kind.lower()}-{index}", _command(container, runs), env, grace))
    return pods


def trainjob_pods(manifest: dict[str, Any], runs: Path, port: int) -> list[Pod]:
    """The pods Kubeflow Trainer makes of a TrainJob (trainer.kubeflow.org/v1alpha1) on the ``torch-distributed``
    runtime: ``numNodes`` pods, each with torchrun's ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``
    (the pod's index), ``PET_MASTER_ADDR`` (node 0's pod, ``<job>-node-0-0.<job>``) and ``PET_MASTER_PORT``
    (29400); no ``MASTER_ADDR``/``RANK``/``WORLD_SIZE``. On loopback node 0 is 127.0.0.1 and the port ``port``."""
    name, trainer = manifest["metadata"]["name"], manifest["spec"]["trainer"]
    nodes, nproc = int(trainer["numNodes"]), str(trainer.get("numProcPerNode", "auto"))
    return [
        Pod(
            f"{name}-node-0-{rank}",
            _command(trainer, runs),
            {
                **{e["name"]: str(e["value"]) for e in trainer.get("env", [])},
                "PET_NNODES": str(nodes),
                "PET_NPROC_PER_NODE": nproc,
                "PET_NODE_RANK": str(rank),
                "PET_MASTER_ADDR": LOOPBACK,
                "PET_MASTER_PORT": str(port),
            },
            DEFAULT_GRACE,  # set in the runtime's pod template; the manifest leaves it at Kubernetes' default
        )
        for rank in range(nodes)
    ]


class Running:
    """A pod's container running as a process (``cwd``: the image's working directory, the repository here)."""

    def __init__(self, pod: Pod, log: Path) -> None:
        self.pod, self.log = pod, log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                pod.command,
                cwd=REPO,
                # Each pod would have its own CPUs; on loopback all share this machine's: one thread per rank.
                env={**user_env(), "OMP_NUM_THREADS": "1", **pod.env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a pod's processes are one group: what Kubernetes' SIGKILL ends at once
            )

    def kill(self) -> None:
        """SIGKILL the pod's processes (torchrun and its ranks), as Kubernetes does after the grace period."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


@pytest.fixture
def started() -> Iterator[list[Running]]:
    """The pods a test started; any still running at its end (a failure) are killed with their ranks."""
    running: list[Running] = []
    yield running
    for r in running:
        if r.process.poll() is None:
            r.kill()


def _start(pods: list[Pod], out: Path, attempt: str, started: list[Running]) -> list[Running]:
    running = [Running(pod, out / f"{pod.name}.{attempt}.log") for pod in pods]
    started.extend(running)
    return running


def _finish(running: list[Running], timeout: float = 300) -> list[int]:
    codes = []
    for r in running:
        try:
            codes.append(r.process.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{r.pod.name} did not end\n{r.text()[-3000:]}") from None
    return codes


def _logs(running: list[Running]) -> str:
    return "\n".join(f"--- {r.pod.name}\n{r.text()[-3000:]}" for r in running)


def test_pytorchjob_and_trainjob_pods_train_and_a_preempted_pod_saves_and_its_restart_resumes(tmp_path, started):
    manifests = {kind: yaml.safe_load((MANIFESTS / f"{kind}.yaml").read_text()) for kind in ("pytorchjob", "trainjob")}
    assert manifests["pytorchjob"]["kind"] == "PyTorchJob" and manifests["trainjob"]["kind"] == "TrainJob"
    trainjob = trainjob_pods(manifests["trainjob"], tmp_path / "tj", free_port())
    reference = _start(trainjob, tmp_path, "0", started)
    pytorchjob = pytorchjob_pods(manifests["pytorchjob"], tmp_path / "ptj", free_port())
    preempted = _start(pytorchjob, tmp_path, "0", started)
    first = tmp_path / "ptj" / "synthetic_dlrm" / "lightning_logs" / "version_0" / "checkpoints"
    first = first / f"epoch=0-step={EVERY}.ckpt"
    wait_for("the PyTorchJob's first periodic checkpoint", lambda: is_checkpoint(first), 300, lambda: _logs(preempted))
    # Kubernetes stops the worker pod: SIGTERM to its container's first process (torchrun), SIGKILL after the grace
    # period. The master pod's rank, told by the other, saves at the same step; its torchrun then fails too.
    worker = preempted[1]
    assert worker.pod.name == "lightning-rec-worker-0", worker.pod.name
    signalled = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)
    codes = _finish([worker], timeout=worker.pod.grace)
    took = time.monotonic() - signalled
    codes = _finish(preempted[:1], timeout=60) + codes
    text = _logs(preempted)
    assert all(code != 0 for code in codes), (codes, text)  # both pods failed: Kubernetes restarts them
    assert took < worker.pod.grace, took
    stops = re.findall(r"\[rank (\d)\] preempted by SIGTERM at step (\d+); checkpoint (\S+)", text)
    assert sorted(rank for rank, _, _ in stops) == ["0", "1"], text
    assert len({(step, path) for _, step, path in stops}) == 1, stops  # the same step, one checkpoint
    step, hpc = int(stops[0][1]), Path(stops[0][2])
    assert EVERY <= step < STEPS and is_checkpoint(hpc), (step, hpc)

    # The restarted pods: the same command and environment; `--ckpt_path=last` finds the checkpoint.
    restarted = _start(pytorchjob, tmp_path, "1", started)
    assert _finish(restarted) == [0, 0], _logs(restarted)
    assert f"ckpt_path='last': resuming from {hpc}" in _logs(restarted), _logs(restarted)

    assert _finish(reference) == [0, 0], _logs(reference)
    assert "sharding plan over 2 rank(s), 1 per host" in _logs(reference)  # 2 pods: 2 hosts to the planner
    expected = weights(next((tmp_path / "tj").rglob(FINAL)), tmp_path / "tj.pt")
    finals = sorted((tmp_path / "ptj").rglob(FINAL))
    assert len(finals) == 1, finals
    assert_same_weights(weights(finals[0], tmp_path / "ptj.pt"), expected)
