"""Internal mechanisms of the strategy, callable on their own, to measure each apart from the step it is part of
(``benchmarks/``: the CPU lookup's kernels, the input checks, the output reordering, the clean exit, the
agreement on a preemption signal).

:class:`~lightning_rec.RecShardStrategy` runs all of these itself; its arguments switch them for a whole run
(``fast_cpu_lookup=``, ``bounds_check=``, ``nonfinite=``). These entry points give a benchmark the same code on a
model sharded by hand (``DistributedModelParallel``, :func:`~lightning_rec.testing.reference.reference_dmp`) or on
a bare FBGEMM kernel, with a switch per call where a measurement alternates with and without it. They are thin:
each calls the implementation the strategy uses.

Example::

    lookups = cpu_lookups(dmp)                  # recshard's CPU lookup on every fused CPU TBE of a DMP
    for lookup in lookups:
        lookup.enable(False)                    # FBGEMM's own forward again (same bits), to time against it
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_rec import _compat
from lightning_rec._inputs.checks import InputChecks
from lightning_rec._inputs.specs import FeatureTables, ModuleInputs, input_specs
from lightning_rec._strategy import cpu_lookup as _cpu_lookup
from lightning_rec._strategy import faults as _faults
from lightning_rec._strategy import preemption as _preemption
from lightning_rec._strategy import unsharded as _unsharded
from lightning_rec.config import NonFinitePolicy

if TYPE_CHECKING:  # FBGEMM ships no type information: to the type checker its TBE is Any
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

__all__ = [
    "TRIAL_CALLS",
    "TRIAL_STEPS",
    "OutputReordering",
    "StepInputChecks",
    "close_process_group_at_exit",
    "cpu_lookup",
    "cpu_lookup_path",
    "cpu_lookups",
    "preemption_agreement",
]

_OUTPUT_DIST = "compute_and_output_dist"
#: Training steps a CPU lookup above its work threshold times on each path (in a block each, after an untimed one)
#: before it keeps the faster.
TRIAL_STEPS = _cpu_lookup.TRIAL_STEPS
#: Training calls from the start of such a trial to its choice (what a benchmark's warm-up must hold).
TRIAL_CALLS = _cpu_lookup.TRIAL_CALLS


def cpu_lookup(
    tbe: SplitTableBatchedEmbeddingBagsCodegen, threads: int | None = None, min_work: int | None = None
) -> _cpu_lookup.CpuLookup:
    """Switch one FBGEMM CPU table-batched embedding (TBE) to recshard's CPU lookup, the faster forward and
    threaded backward + update that ``RecShardStrategy(fast_cpu_lookup=True)`` gives every eligible CPU TBE
    (bitwise identical to FBGEMM's own; see ``lightning_rec/_strategy/cpu_lookup.py``).

    Args:
        tbe: a ``SplitTableBatchedEmbeddingBagsCodegen`` on CPU, sum pooling, fp32, ``EXACT_SGD`` or
            ``EXACT_ADAGRAD``.
        threads: threads of the backward (the tables are split into at most this many groups); default
            ``torch.get_num_threads()``.
        min_work: the least ``ids x mean dim`` of a call that takes the split, as the strategy's default
            (:func:`cpu_lookup_path`) when ``None``; ``0`` splits every call (with more than one thread).

    Returns:
        The lookup, now the TBE's forward; ``lookup.enable(False)`` gives the TBE FBGEMM's forward back,
        ``lookup.enable()`` this one again.

    Raises:
        ValueError: naming why the TBE must keep FBGEMM's forward (another optimizer, pooling or precision).

    Example::

        >>> from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ...     ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen)
        >>> from fbgemm_gpu.split_embedding_configs import EmbOptimType
        >>> tbe = SplitTableBatchedEmbeddingBagsCodegen([(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)] * 2,
        ...                                            optimizer=EmbOptimType.EXACT_SGD)
        >>> lookup = cpu_lookup(tbe, threads=2)
        >>> tbe(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3])).shape   # 1 sample: 1 id, then 2 ids
        torch.Size([1, 8])
        >>> lookup.enable(False)                                            # FBGEMM's forward again
    """
    lookup = _cpu_lookup.CpuLookup(tbe, tbe.forward, threads=threads, min_work=min_work)
    lookup.enable()
    return lookup


def cpu_lookup_path(ids: int, mean_dim: float, threads: int) -> str:
    """The path recshard's CPU lookup takes by default for one call of ``ids`` ids into tables of ``mean_dim``
    columns with ``threads`` intra-op threads: ``"fast"`` (torch's threaded forward, FBGEMM's backward split by
    table) or ``"fbgemm"`` (FBGEMM's own kernels: below the work where the split pays, or one thread). Same bits
    either way; the choice changes the time only (``benchmarks/cpu_lookup_sweep.py``).

    Example::

        >>> cpu_lookup_path(ids=3 * 64, mean_dim=16, threads=2)     # 3 tables, batch 64, one id per feature
        'fbgemm'
    """
    return _cpu_lookup.choose_path(ids, mean_dim, threads)


def cpu_lookups(model: nn.Module, threads: int | None = None) -> list[_cpu_lookup.CpuLookup]:
    """Give every eligible fused CPU TBE of a model sharded by hand recshard's CPU lookup (what
    ``RecShardStrategy(fast_cpu_lookup=True)`` does after sharding) and return the lookups, to switch each between
    it and FBGEMM's own forward (same weights, same bits) with ``lookup.enable(on)``.

    With one intra-op thread (``threads``, default ``torch.get_num_threads()``) nothing is installed and the list is
    empty, as in the strategy: the backward has nothing to split.

    Args:
        model: a ``DistributedModelParallel`` (or any module holding TorchRec's sharded embedding modules).
        threads: the threads the lookups may use.

    Example::

        dmp = DistributedModelParallel(model, device=torch.device("cpu"), ...)
        lookups = cpu_lookups(dmp)              # [<one per TBE>]: all on
        for lookup in lookups:
            lookup.enable(False)                # FBGEMM's CPU forward and serial fused backward, as TorchRec's
    """
    _cpu_lookup.install_cpu_lookup(model, threads)
    return _cpu_lookup.cpu_lookups(model)


def close_process_group_at_exit(timeout: timedelta | None = None) -> None:
    """Make a process that ran collectives end cleanly: at interpreter exit, wait for the other ranks and destroy
    the default process group, which ``RecShardStrategy`` registers in every rank it sets up (idempotent; the
    latest ``timeout`` wins).

    Without it, a finished two-rank gloo job can abort at exit with ``terminate called without an active
    exception`` (a gloo worker thread unwound while the interpreter finalizes); ``benchmarks/clean_exit.py``
    counts how often, with and without.

    Args:
        timeout: how long the exit waits for the other ranks (default: the process group's).

    Example::

        dist.init_process_group("gloo")
        close_process_group_at_exit()
        dist.all_reduce(torch.ones(1))          # ... and return: the process exits 0
    """
    _faults.close_process_group_at_exit(timeout)


class StepInputChecks:
    """The input checks ``RecShardStrategy(bounds_check="error", nonfinite=...)`` runs for a training step, called
    by hand, to time them apart from the step they protect: the host checks of a batch before its copy to the device
    (every KJT's lengths, offsets and ids against its table; NaN/inf in the dense tensors), the door check of a
    sharded table module (features, dtypes, shapes; contents only if the host did not check them) and the loss.

    Args:
        model: the model before sharding (its tables may be on ``meta``): each TorchRec embedding module in it is
            a door, by module path, and its tables' sizes are what the ids are checked against.
        nonfinite: as the strategy's: ``"error"`` (the default: the loss is read one step later without a host
            sync), ``"strict"``, ``"warn"`` or ``"ignore"``.

    Errors are the strategy's: :class:`~lightning_rec.errors.InputError`,
    :class:`~lightning_rec.errors.NonFiniteError`.

    Example::

        checks = StepInputChecks(model)                 # before DistributedModelParallel(model, ...)
        checks.check_host(batch)                        # on the host, before the copy to the device
        checks.check_door(batch.sparse_features, "tables")
        loss, _ = dmp(batch)
        checks.check_loss(loss)
        assert checks.door_reads == 0                   # the door trusted what the host had checked
    """

    def __init__(self, model: nn.Module, nonfinite: NonFinitePolicy = "error") -> None:
        self._specs: dict[str, ModuleInputs] = input_specs(model)
        self._checks = InputChecks(check_ids=True, nonfinite=nonfinite, position=lambda ahead, batch=None: "")
        self._checks.tables = FeatureTables.of(self._specs)

    @property
    def modules(self) -> list[str]:
        """The paths of the table modules whose doors :meth:`check_door` checks."""
        return list(self._specs)

    @property
    def door_reads(self) -> int:
        """How many KJTs a door had to read the contents of (the host had not checked them)."""
        return self._checks.door_reads

    def check_host(self, batch: Any, trust: bool = True) -> None:
        """The checks of ``batch`` before its copy to the device (``batch_to_device`` runs them).

        Args:
            batch: any batch (a dataclass, dict, tuple, ``Batch``...) holding ``KeyedJaggedTensor`` s and tensors.
            trust: let the doors skip the contents of this same batch's KJTs (the batch is its own device copy on
                CPU); ``False`` times the host checks alone.
        """
        checked = self._checks.check_host(batch)
        if trust:
            self._checks.trust(checked, batch)

    def check_door(self, features: Any, module: str) -> None:
        """The check of what the sharded table module at path ``module`` is given (its ``input_dist`` runs it)."""
        self._checks.at_door(features, self._specs[module])

    def check_loss(self, loss: torch.Tensor) -> None:
        """The check of the step's loss (with ``nonfinite="error"``: copied to host memory now, read next step)."""
        self._checks.check_loss(loss)


class OutputReordering:
    """Restoring the unsharded output order of a model's table modules after sharding it by hand, as
    ``RecShardStrategy`` does for every sharded ``EmbeddingBagCollection``/``EmbeddingCollection``, with a switch to
    time the reordering against the sharded order on the same model.

    A sharded module whose plan mixes sharding types returns its keys grouped by sharding type; after
    :meth:`install`, its first output decides: keys already in the unsharded order remove the wrapper (nothing to
    pay per step), others are put back in order on every output from then on.

    Args:
        model: the model before sharding (the unsharded orders are read from its table modules).

    Example::

        reordering = OutputReordering(model)            # before sharding
        dmp = DistributedModelParallel(model, ...)
        reordering.install(dmp.module)
        dmp.module.ebc(kjt).wait().keys()               # the unsharded order (the first output decided)
        reordering.enable(dmp.module, False)            # the sharded order, as TorchRec returns it
        reordering.enable(dmp.module, True)             # reordered again
    """

    def __init__(self, model: nn.Module) -> None:
        self.orders: dict[str, list[str]] = _unsharded.output_orders(model)
        """By module path, the output keys in the unsharded order."""
        self._reorderings: dict[int, Any] = {}  # by id(sharded module): its reordering, while switched off

    def install(self, sharded_root: nn.Module) -> None:
        """Make every sharded table module of ``sharded_root`` (``dmp.module``) return the unsharded order."""
        _unsharded.restore_output_order(sharded_root, self.orders)

    def reordered(self, sharded_root: nn.Module) -> list[str]:
        """The paths of the modules whose outputs are being reordered (after their first output)."""
        return [
            path for path, module in self._modules(sharded_root).items() if _compat.is_patched(module, _OUTPUT_DIST)
        ]

    def enable(self, sharded_root: nn.Module, on: bool = True) -> None:
        """Switch the reordering of every module that needs it off (``on=False``: TorchRec's sharded order) or back
        on (call it after each module's first output, which decides whether it needs reordering)."""
        for module in self._modules(sharded_root).values():
            if on and id(module) in self._reorderings:
                _compat.patch_method(module, _OUTPUT_DIST, self._reorderings.pop(id(module)))
            elif not on and _compat.is_patched(module, _OUTPUT_DIST):
                self._reorderings[id(module)] = getattr(module, _OUTPUT_DIST)
                _compat.unpatch_method(module, _OUTPUT_DIST)

    def _modules(self, sharded_root: nn.Module) -> dict[str, nn.Module]:
        modules = {path: sharded_root.get_submodule(path) if path else sharded_root for path in self.orders}
        return {path: m for path, m in modules.items() if _compat.patchable(m, _OUTPUT_DIST)}


def preemption_agreement(world_size: int) -> Callable[[], int]:
    """The strategy's agreement on a preemption signal, as one call per training batch on every rank (after the
    process group started): returns the signal the ranks agreed was received (0: none) on the strategy's schedule
    (:class:`~lightning_rec._strategy.preemption.Preemption`). Make it before the first batch; it makes its group.

    Example::

        agreed = preemption_agreement(world_size=2)
        for batch in batches:
            step(batch)
            if agreed():
                break
    """
    preemption = _preemption.Preemption()
    preemption.start(world_size)
    return preemption.agreed
