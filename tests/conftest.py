"""Test tiers, and test isolation for runs inside the pytest process (e.g. the CLI tests' ``run([...])``).

Tiers (declared in ``pyproject.toml``): a test that starts processes (gloo ranks through ``tests.helpers.dist``, the
``lightning-rec`` CLI or a script in a subprocess, torchrun, Lightning's own launcher, spawned DataLoader workers)
or runs a whole ``fit`` in this process is marked ``dist`` (the slow tier). Plain ``pytest`` runs the fast tier;
``pytest -m dist`` the slow one alone; ``pytest -m ""`` everything (what CI runs).

Isolation:

Lightning's launcher writes MASTER_ADDR/MASTER_PORT/... into ``os.environ`` and leaves the process group (and
its TCP store, holding that port) alive. A later test that starts processes of its own would inherit that
port and fail with EADDRINUSE; so every test gets its environment back and no process group outlives it.
Each test also runs in its own temporary working directory.
"""

import os

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _isolate_distributed_state(tmp_path, monkeypatch):
    # Runs with logger=False write into default_root_dir (the cwd): keep that out of the checkout.
    monkeypatch.chdir(tmp_path)
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
