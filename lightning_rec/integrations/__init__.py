"""Other engines that run recshard jobs, each in its own module, each behind an optional extra.

* :mod:`lightning_rec.integrations.ray`: Ray Train (``pip install lightning_rec[ray]``): checkpoints reported to
  Ray as sharded directories and restored from ``ray.train.get_checkpoint()``.

Nothing is imported here, so that ``import lightning_rec`` never needs an optional dependency.
"""

__all__: list[str] = []
