"""Support shared by the tests, the bench and ``benchmarks/`` (as TorchRec ships ``torchrec.distributed.test_utils``).

* :class:`~lightning_rec.testing.syncs.SyncCounter`: count the host-device synchronisations a piece of code makes,
  and which Python frame asked for each.
* :func:`~lightning_rec.testing.ports.free_port`: a free TCP port on ``127.0.0.1`` for ``MASTER_PORT``.
"""

from lightning_rec.testing.ports import free_port
from lightning_rec.testing.syncs import SyncCounter

__all__ = ["SyncCounter", "free_port"]
