"""Other engines that run recshard jobs, each in its own module, each behind an optional extra.

* :mod:`lightning_rec.integrations.ray`: Ray Train (``pip install lightning_rec[ray]``): checkpoints reported to
  Ray as sharded directories and restored from ``ray.train.get_checkpoint()``.
* :mod:`lightning_rec.integrations.torchrun`: torchrun (no extra), whose agent ends a Kubernetes SIGTERM in one line
  and exit code 143 rather than a ``SignalException`` traceback.

Nothing is imported here, so that ``import lightning_rec`` never needs an optional dependency.
"""

__all__: list[str] = []
