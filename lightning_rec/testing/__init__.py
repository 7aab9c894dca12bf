"""Support shared by the tests, the bench and ``benchmarks/`` (as TorchRec ships ``torchrec.distributed.test_utils``).

* :class:`~lightning_rec.testing.syncs.SyncCounter`: count the host-device synchronisations a piece of code makes,
  and which Python frame asked for each.
"""

from lightning_rec.testing.syncs import SyncCounter

__all__ = ["SyncCounter"]
