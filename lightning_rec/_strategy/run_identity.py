"""Which run a checkpoint belongs to: what ``ckpt_path="last"`` (and SLURM's requeue start) compare before resuming.

A run is named by the first of:

1. the user's own id: ``RecShardStrategy(run_id=...)`` (``--trainer.strategy.init_args.run_id=...``) or the
   ``LIGHTNING_REC_RUN_ID`` environment variable, as given: it alone names the run (e.g. to continue a run under a
   new SLURM job, or after changing its config on purpose);
2. otherwise the launcher's id, the same across the restarts it makes (``SLURM_JOB_ID``: a requeued job keeps it;
   ``TORCHELASTIC_RUN_ID``: torchrun's ``--rdzv-id``, kept across ``--max-restarts``, except torchrun's default
   ``none``), together with a fingerprint of the run's configuration: the LightningModule's and the DataModule's
   classes and hyperparameters (``save_hyperparameters``). A Kubernetes pod restarted by its operator runs the
   same command with the same configuration, so its fingerprint (and the torchrun id it may carry) names it.

So a new experiment in the same ``default_root_dir`` (a changed ``dense_lr``) or another SLURM job is another run,
while a restarted, requeued or re-run job is the same one. The name is recorded in every checkpoint's manifest
(``COMPLETE``'s ``"run"``), and read back without loading anything.

Example::

    >>> run_identity(None, None, environ={"SLURM_JOB_ID": "81"}, explicit=None)
    'slurm:81/config:8150f452841e'
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["RUN_ID_ENV", "run_identity"]

RUN_ID_ENV = "LIGHTNING_REC_RUN_ID"

# The launchers' ids, each the same on every rank and across the restarts the launcher makes.
_LAUNCHER_IDS = (("SLURM_JOB_ID", "slurm"), ("TORCHELASTIC_RUN_ID", "torchrun"))
_UNSET = {"", "none"}  # torchrun's default --rdzv-id: every torchrun invocation has it, so it names no run

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # object reprs: an address differs in every process


def _stable(value: Any) -> str:
    return _ADDRESS.sub("", repr(value))


def _describe(obj: Any) -> dict[str, Any] | None:
    if obj is None:
        return None
    hparams = getattr(obj, "hparams", None)
    return {"class": f"{type(obj).__module__}.{type(obj).__qualname__}", "hparams": dict(hparams or {})}


def config_fingerprint(module: Any, datamodule: Any) -> str:
    """12 hex digits of the SHA-256 of the module's and datamodule's classes and hyperparameters."""
    document = {"model": _describe(module), "data": _describe(datamodule)}
    text = json.dumps(document, sort_keys=True, default=_stable)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def run_identity(
    module: Any, datamodule: Any, *, environ: Mapping[str, str] | None = None, explicit: str | None = None
) -> str:
    """The name of the run training ``module`` on ``datamodule`` (see the module docstring).

    Args:
        module: the LightningModule (``None``: not known).
        datamodule: the LightningDataModule, if any.
        environ: the environment to read the launchers' ids from (default: ``os.environ``).
        explicit: the strategy's ``run_id`` argument.

    Returns:
        ``"user:<id>"``, or ``"<launcher>:<id>/config:<fingerprint>"``, or ``"config:<fingerprint>"``.
    """
    environ = os.environ if environ is None else environ
    given = explicit if explicit is not None else environ.get(RUN_ID_ENV, "")
    if given.strip():
        return f"user:{given.strip()}"
    config = f"config:{config_fingerprint(module, datamodule)}"
    for variable, launcher in _LAUNCHER_IDS:
        value = environ.get(variable, "").strip()
        if value.lower() not in _UNSET:
            return f"{launcher}:{value}/{config}"
    return config
