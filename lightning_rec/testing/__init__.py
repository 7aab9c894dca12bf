"""Support shared by the tests, the bench and ``benchmarks/`` (as TorchRec ships ``torchrec.distributed.test_utils``).

* :func:`~lightning_rec.testing.launch.launch`, :func:`~lightning_rec.testing.launch.run_ranks`: start N ranks
  (as torchrun, srun or torchrun agents on several "hosts" would), each running a scenario, and collect results
  (imported from :mod:`lightning_rec.testing.launch`, the module's name being ``launch`` too).
* :func:`~lightning_rec.testing.ports.free_port`: a free TCP port on ``127.0.0.1`` for ``MASTER_PORT``;
  :func:`~lightning_rec.testing.ports.shell_env`: the environment of a user's fresh shell (no rendezvous variables).
* :func:`~lightning_rec.testing.init.deterministic_init` (and its :func:`~lightning_rec.testing.init.pattern`):
  starting weights that depend on name and global index only, whatever the plan or world size.
* :func:`~lightning_rec.testing.reference.reference_dmp`, :func:`~lightning_rec.testing.reference.reference_optimizer`:
  the hand-written TorchRec loop's sharded model (planner + ``DistributedModelParallel``) and optimizer.
* :class:`~lightning_rec.testing.failures.FailAt`, :func:`~lightning_rec.testing.failures.failure_time`: make a
  rank raise, die, hang or get a bad id at a given step, and tell when it did.
* :data:`~lightning_rec.testing.trainer.QUIET_TRAINER`: the ``Trainer`` arguments of a measured or compared run.
* :class:`~lightning_rec.testing.syncs.SyncCounter`: count the host-device synchronisations a piece of code makes,
  and which Python frame asked for each.
* :func:`~lightning_rec.testing.instruments.cpu_lookup`, :func:`~lightning_rec.testing.instruments.cpu_lookups`,
  :func:`~lightning_rec.testing.instruments.cpu_lookup_path`,
  :class:`~lightning_rec.testing.instruments.StepInputChecks`,
  :class:`~lightning_rec.testing.instruments.OutputReordering`,
  :func:`~lightning_rec.testing.instruments.close_process_group_at_exit`: the strategy's CPU lookup, input checks,
  output reordering and clean exit, on their own (on a model sharded by hand, a bare FBGEMM kernel, a plain process
  group), to measure each apart from the step it is part of (``benchmarks/``).
"""

from lightning_rec.testing.failures import FailAt, failure_time
from lightning_rec.testing.init import deterministic_init, pattern
from lightning_rec.testing.instruments import (
    OutputReordering,
    StepInputChecks,
    close_process_group_at_exit,
    cpu_lookup,
    cpu_lookup_path,
    cpu_lookups,
)
from lightning_rec.testing.ports import free_port, shell_env
from lightning_rec.testing.reference import reference_dmp, reference_optimizer
from lightning_rec.testing.syncs import SyncCounter
from lightning_rec.testing.trainer import QUIET_TRAINER

__all__ = [
    "FailAt",
    "OutputReordering",
    "QUIET_TRAINER",
    "StepInputChecks",
    "SyncCounter",
    "close_process_group_at_exit",
    "cpu_lookup",
    "cpu_lookup_path",
    "cpu_lookups",
    "deterministic_init",
    "failure_time",
    "free_port",
    "pattern",
    "reference_dmp",
    "reference_optimizer",
    "shell_env",
]
