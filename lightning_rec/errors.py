"""Every exception a user of this package can catch, in one place.

This module imports nothing from ``lightning_rec``: every other module may raise these without import cycles.
Each class is also importable from the module that raises it (``lightning_rec.errors.InputError``,
``lightning_rec.checkpoint.CheckpointError``, ...), and the input errors from ``lightning_rec`` itself.

Example::

    >>> from lightning_rec.errors import InputError
    >>> issubclass(InputError, ValueError)
    True
"""

from __future__ import annotations

import pickle

__all__ = [
    "CheckpointError",
    "CheckpointReplacedError",
    "ExportError",
    "InputError",
    "NonFiniteError",
    "Preempted",
    "ServingError",
    "UnsafeCheckpointError",
]


class InputError(ValueError):
    """A batch the embedding tables cannot take. The message names the module, feature, table, offending value
    and what was expected, and where in training it happened; nothing was updated with the batch.

    Raised by :func:`~lightning_rec._inputs.kjt.check_on_host` and :func:`~lightning_rec._inputs.kjt.check_features`,
    which :class:`~lightning_rec._inputs.checks.InputChecks` runs on every batch (``bounds_check="error"``, the default of
    :class:`~lightning_rec.RecShardStrategy`): a missing or extra feature, a wrong dtype or shape, lengths that do
    not add up, or an id outside its table.
    """


class NonFiniteError(ValueError):
    """NaN or infinity in a dense input (refused before the step) or in the loss (see ``nonfinite`` of
    :class:`~lightning_rec.RecShardStrategy`).

    Raised by :class:`~lightning_rec._inputs.checks.InputChecks` with ``nonfinite="error"`` (the default) or ``"strict"``.
    """


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked: incomplete, corrupt, or not matching the model.

    Raised when loading or exporting a sharded checkpoint (:mod:`lightning_rec.checkpoint`): a missing or
    mismatching ``COMPLETE`` manifest, a file whose size or SHA-256 differs from it, or tensors the model lacks.
    """


class CheckpointReplacedError(CheckpointError):
    """A checkpoint was replaced by a newer save while it was being read; nothing was read from it, and reading it
    again gets the newer one (``trainer.fit/validate/test/predict`` and the exports already retry a few times).

    Example::

        try:
            model = MyModel.load_from_checkpoint("runs/x/checkpoints/last.ckpt")
        except CheckpointReplacedError:
            model = MyModel.load_from_checkpoint("runs/x/checkpoints/last.ckpt")  # the newer one
    """


class Preempted(SystemExit):
    """A fit stopped by a preemption signal (SIGTERM, or SLURM's requeue signal) at a batch boundary, after every
    rank saved a checkpoint; the process exits with ``128 + signal`` (143 for SIGTERM, 138 for SIGUSR1).

    Raised by :class:`~lightning_rec.RecShardStrategy` on every rank at the same step (see
    :mod:`lightning_rec._strategy.preemption`); a callback's ``on_exception`` sees it like any other exception.

    Example::

        >>> err = Preempted("preempted by SIGTERM at step 7; checkpoint hpc_ckpt_1.ckpt", 143)
        >>> err.code, str(err)
        (143, 'preempted by SIGTERM at step 7; checkpoint hpc_ckpt_1.ckpt')
    """

    def __init__(self, message: str, code: int) -> None:
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file refers to a Python object that loading will not create.

    Raised while reading a checkpoint's ``.metadata`` or ``meta.pt``
    (:mod:`lightning_rec.checkpoint._safe_io`) when they name a class outside the allow-list; for a checkpoint
    you trust, pass ``weights_only=False`` to ``trainer.fit/validate/test/predict``.
    """


class ExportError(ValueError):
    """A model (or a part of it) that cannot become a serving artifact, naming the part and why; nothing was
    written. Raised by :func:`lightning_rec.serving.export_inference` (``lightning-rec export --format torchscript``
    or ``--format pt2``).
    """


class ServingError(RuntimeError):
    """A serving package that cannot be loaded here, naming why: a ``.pt2`` compiled under another torch or FBGEMM
    (it runs only under the ones that compiled it), or a file that is not a package lightning_rec wrote. Raised by
    :func:`lightning_rec.serving.load_pt2`.
    """
