"""Support shared by the tests, the bench and ``benchmarks/`` (as TorchRec ships ``torchrec.distributed.test_utils``).

* :class:`~lightning_rec.testing.syncs.SyncCounter`: count the host-device synchronisations a piece of code makes,
  and which Python frame asked for each.
* :func:`~lightning_rec.testing.ports.free_port`: a free TCP port on ``127.0.0.1`` for ``MASTER_PORT``.
* :func:`~lightning_rec.testing.init.deterministic_init` (and its :func:`~lightning_rec.testing.init.pattern`):
  starting weights that depend on name and global index only, whatever the plan or world size.
* :class:`~lightning_rec.testing.failures.FailAt`, :func:`~lightning_rec.testing.failures.failure_time`: make a
  rank raise, die, hang or get a bad id at a given step, and tell when it did.
"""

from lightning_rec.testing.failures import FailAt, failure_time
from lightning_rec.testing.init import deterministic_init, pattern
from lightning_rec.testing.ports import free_port
from lightning_rec.testing.syncs import SyncCounter

__all__ = ["FailAt", "SyncCounter", "deterministic_init", "failure_time", "free_port", "pattern"]
