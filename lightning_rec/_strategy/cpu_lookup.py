"""A faster CPU path through FBGEMM's fused table-batched embedding (TBE), bitwise identical to FBGEMM's own.

On CPU, FBGEMM's fused TBE runs its forward on one thread and its fused backward + optimizer update as one
serial pass over all tables (BENCHMARKS.md, "The CPU step against the sparse peer"). Both have a faster
equivalent that gives the same bits:

- **forward**: ``torch.nn.functional.embedding_bag`` on each feature's table (a view of the TBE's own weights),
  which runs the same FBGEMM ``EmbeddingSpMDM`` kernel over the bags on every intra-op thread. Sum pooling only
  (mean pooling divides in another order: 1 ulp apart), fp32 weights and output;
- **backward + update**: FBGEMM's own CPU backward op, the one its autograd function calls, once per group of
  tables, the groups on separate threads. Each table's rows are updated by exactly the ids and gradients that
  FBGEMM's single call would use for them, in the same order: the tables are disjoint memory, so the result is
  the same to the bit.

Only ``EXACT_SGD`` and ``EXACT_ADAGRAD`` take this path (their FBGEMM forward passes nothing else to the op);
any other optimizer, pooling, precision, variable batch sizes or a CUDA table keeps FBGEMM's own forward.
Install with :func:`install_cpu_lookup` (the strategy does, unless ``RecShardStrategy(fast_cpu_lookup=False)``); with
one intra-op thread per rank it keeps FBGEMM's path, which is as fast there.

**Which path, call by call.** The split is not free: its own work (one ``embedding_bag`` per feature, their
concatenation, the per-group id copies, the hand-off to the thread pool) is a fixed ~0.3-0.5 ms a step. Its threads
are born with one intra-op thread each (:mod:`lightning_rec._strategy.backward_threads`): a thread that ran a multi-threaded OpenMP region
would keep OpenMP workers of its own, and with more OpenMP threads than cores GNU OpenMP makes every parallel region
of the process (the MLP's, FBGEMM's) wait for its workers to wake, which once made FBGEMM's path 2.4x slower beside
the split's idle threads (``benchmarks/split_threads.py``; BENCHMARKS.md, "The split's threads slowed the whole
process").

That fixed cost outweighs the gain on small lookups, so each call first prices its own work, ``ids x mean dim`` (the
floats the lookup reads and the update writes; batch, pooling and feature count are in the ids): below
:data:`MIN_FAST_WORK`, or with one thread, FBGEMM's path, always (:func:`choose_path`), and no thread pool is ever
started. Above it the split won by 13-24% on a quiet machine and can lose with the cores shared, so there the
lookups measure: one :class:`PathTrial` per model (its lookups share it: the split's threads are the process's, not
one table's) times whole training steps (call to call), a block on each path, FBGEMM's with the split's threads
stopped (:func:`release_threads`), takes the faster, stops the threads if that is FBGEMM's, and measures again every
:data:`RETRY_EVERY` calls. Either path gives the same bits, so the choice changes the time only.
``benchmarks/cpu_lookup_sweep.py`` measures both paths from tiny to large (BENCHMARKS.md, "Never slower than
FBGEMM's path").
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_rec import _compat
from lightning_rec._strategy.backward_threads import release_threads, run_on_threads

if TYPE_CHECKING:  # FBGEMM ships no type information: to the type checker its TBE is Any
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

# FBGEMM's CPU backward op per optimizer (what its own autograd function calls after the forward).
_BACKWARD_OPS = {
    "EXACT_SGD": "split_embedding_backward_codegen_sgd_cpu",
    "EXACT_ADAGRAD": "split_embedding_backward_codegen_adagrad_cpu",
}

#: The least work (ids x mean embedding dim of one call) for which the split path may be taken, where a trial
#: measures it faster: below it, FBGEMM's own path was faster at every row of BENCHMARKS.md's "Never slower than
#: FBGEMM's path", by 2-20% (medium_wide, 2,097,152: 10.9 ms against 12.0); above it the split won by 13-24%.
MIN_FAST_WORK = 1 << 22
#: Training steps timed on each path before a lookup above :data:`MIN_FAST_WORK` picks one (:class:`PathTrial`),
#: and the calls after which it measures again (the machine's load changes which path is faster).
TRIAL_STEPS, RETRY_EVERY = 8, 2000
#: Training calls from a trial's start to its choice: two blocks of an untimed call and TRIAL_STEPS timed ones, and
#: the call that closes the last step (a benchmark warms up at least as many).
TRIAL_CALLS = 2 * (TRIAL_STEPS + 1) + 1
FAST, FBGEMM = "fast", "fbgemm"


def choose_path(ids: int, mean_dim: float, threads: int, min_work: int = MIN_FAST_WORK) -> str:
    """Which path a lookup of ``ids`` ids into tables of ``mean_dim`` columns may take with ``threads`` intra-op
    threads: :data:`FBGEMM` (FBGEMM's own forward and serial backward, always) or :data:`FAST` (the split where it is
    measured faster, :class:`PathTrial`).

    The split's gain grows with the work (``ids x mean_dim``) and its cost is fixed, so it can pay from a threshold
    on, and never with one thread (nothing to split).

    Example::

        >>> choose_path(ids=3 * 64, mean_dim=16, threads=2)          # 3 tables, batch 64, one id each
        'fbgemm'
        >>> choose_path(ids=8 * 4096 * 4, mean_dim=64, threads=2)    # 8 tables, batch 4096, 4 ids each
        'fast'
        >>> choose_path(ids=8 * 4096 * 4, mean_dim=64, threads=1)
        'fbgemm'
    """
    return FAST if threads > 1 and ids * mean_dim >= min_work else FBGEMM


class PathTrial:
    """Times whole training steps on each path in turn, then keeps the faster one (see the module docstring).

    A step is the time from one training call of the lookup to the next (the forward, its backward and update, the
    rest of the step and the next batch's loading): what the choice changes, measured where it is made. A trial runs
    a block of calls on FBGEMM's path, then a block on the split, each block's first call untimed (it warms its path
    up: the split's first call starts its threads, and the first steps of a fit warm caches and the allocator) and
    ``steps`` timed; each interval goes to the path of the call that opened it. Blocks, not alternate calls: the
    split's threads are stopped whenever FBGEMM's path runs (:func:`release_threads`), so alternating would time a
    split that starts its threads anew every step. The path with the lower median is then kept for ``retry_every``
    calls, after which the trial runs again.

    Example::

        >>> trial = PathTrial(steps=1)
        >>> [trial.next(now=t) for t in (0.0, 5.0, 5.5, 9.0, 10.0)]   # FBGEMM's step took 0.5 s, the split's 1 s
        ['fbgemm', 'fbgemm', 'fast', 'fast', 'fbgemm']
    """

    def __init__(self, steps: int = TRIAL_STEPS, retry_every: int = RETRY_EVERY) -> None:
        self.steps, self.retry_every = steps, retry_every
        self.times: dict[str, list[float]] = {FAST: [], FBGEMM: []}
        self.chosen: str | None = None  # None: on trial
        self.current = FBGEMM  # the path of the leading lookup's latest training call (see for_call)
        self._since = 0  # calls since the choice
        self._calls = 0  # calls of the current trial
        self._open: tuple[str, float] | None = None  # the timed trial call whose step is open, and when it began
        self._leader: int | None = None  # id() of the lookup whose calls time the steps

    def for_call(self, lookup: object, now: float) -> str:
        """The path of a training call by ``lookup``, one of the lookups sharing this trial (a model's): the first
        one to call leads (its calls, one per step, are timed by :meth:`next`); the others take the path it took
        in the same step, so that a step runs on one path throughout.

        Example::

            >>> trial = PathTrial(steps=1)
            >>> calls = ((0.0, "a"), (0.1, "b"), (5.0, "a"), (5.1, "b"), (6.0, "a"), (6.1, "b"))
            >>> [trial.for_call(lookup, now=t) for t, lookup in calls]
            ['fbgemm', 'fbgemm', 'fbgemm', 'fbgemm', 'fast', 'fast']
        """
        if self._leader is None:
            self._leader = id(lookup)
        if self._leader == id(lookup):
            self.current = self.next(now)
        return self.current

    def leads(self, lookup: object) -> bool:
        """Whether ``lookup``'s calls time the steps (see :meth:`for_call`)."""
        return self._leader == id(lookup)

    def next(self, now: float) -> str:
        """The path of the training call made at ``now`` (``time.perf_counter()``)."""
        if self._open is not None:
            path, began = self._open
            self.times[path].append(now - began)
            self._open = None
        if self.chosen is not None:
            self._since += 1
            if self._since <= self.retry_every:
                return self.chosen
            self.chosen, self.times, self._calls = None, {FAST: [], FBGEMM: []}, 0
        if min(len(t) for t in self.times.values()) >= self.steps:
            fast, fbgemm = (statistics.median(self.times[p]) for p in (FAST, FBGEMM))
            self.chosen, self._since = (FAST if fast < fbgemm else FBGEMM), 1
            return self.chosen
        block, call = divmod(self._calls, self.steps + 1)
        path = (FBGEMM, FAST)[min(block, 1)]
        if call:  # the first call of a block warms its path up
            self._open = (path, now)
        self._calls += 1
        return path


def ineligible_reason(tbe: SplitTableBatchedEmbeddingBagsCodegen) -> str | None:
    """Why ``tbe`` (a ``SplitTableBatchedEmbeddingBagsCodegen``) must keep FBGEMM's own forward, or ``None``.

    Example::

        >>> from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ...     ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen)
        >>> from fbgemm_gpu.split_embedding_configs import EmbOptimType
        >>> tbe = SplitTableBatchedEmbeddingBagsCodegen([(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        ...                                            optimizer=EmbOptimType.EXACT_SGD)
        >>> ineligible_reason(tbe) is None
        True
    """
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    if type(tbe) is not SplitTableBatchedEmbeddingBagsCodegen:
        return f"{type(tbe).__name__} is not FBGEMM's training TBE"
    if not getattr(tbe, "use_cpu", False) or getattr(tbe, "use_mtia", False):
        return "its tables are not on the CPU"
    if tbe.pooling_mode != PoolingMode.SUM:
        return f"pooling {tbe.pooling_mode.name} (only SUM gives FBGEMM's bits)"
    if tbe.weights_precision != SparseType.FP32 or int(tbe.output_dtype) != SparseType.FP32.as_int():
        return "weights or output not fp32"
    name = _BACKWARD_OPS.get(tbe.optimizer.name)
    if name is None:
        return f"optimizer {tbe.optimizer.name} (only {sorted(_BACKWARD_OPS)})"
    if not hasattr(torch.ops.fbgemm, name):
        return f"this FBGEMM has no torch.ops.fbgemm.{name}"
    missing = [
        a.name for a in getattr(torch.ops.fbgemm, name).default._schema.arguments if a.name not in _arguments(tbe)
    ]
    if missing:
        return f"torch.ops.fbgemm.{name} takes arguments this module does not know: {missing}"
    return None


def _arguments(tbe: SplitTableBatchedEmbeddingBagsCodegen) -> dict[str, Any]:
    """Every argument FBGEMM's CPU backward ops take but the per-step ones, by name, from the TBE (as its own
    forward passes them)."""
    args = tbe.optimizer_args
    out: dict[str, Any] = {
        "grad_output": None,
        "indices": None,
        "offsets": None,
        "indice_weights": None,
        "host_weights": tbe.weights_host,
        "weights_placements": tbe.weights_placements,
        "weights_offsets": tbe.weights_offsets,
        "D_offsets": tbe.D_offsets,
        "max_D": tbe.max_D,
        "hash_size_cumsum": tbe.hash_size_cumsum,
        "total_hash_size_bits": tbe.total_hash_size_bits,
        "pooling_mode": int(tbe.pooling_mode),
        "stochastic_rounding": args.stochastic_rounding,
        "eps": args.eps,
        "output_dtype": int(tbe.output_dtype),
    }
    if hasattr(tbe, "learning_rate_tensor"):  # FBGEMM >= 1.2 keeps the rate in a tensor the fused optimizer sets
        out["learning_rate_tensor"] = tbe.learning_rate_tensor
    if tbe.momentum1_host.numel():
        out.update(
            momentum1_host=tbe.momentum1_host,
            momentum1_placements=tbe.momentum1_placements,
            momentum1_offsets=tbe.momentum1_offsets,
        )
    return out


class CpuLookup:
    """The forward that replaces one CPU TBE's (see the module docstring); ``tbe.forward = CpuLookup(tbe, ...)``.

    Args:
        tbe: an eligible ``SplitTableBatchedEmbeddingBagsCodegen`` (:func:`ineligible_reason` is ``None``).
        fbgemm_forward: its original bound ``forward``, for the calls this path does not take (variable batch
            sizes, extra arguments).
        threads: threads of the backward (the tables are split into at most this many groups); default
            ``torch.get_num_threads()``.
        min_work: the least ``ids x mean dim`` of a call that may take the split, where it is measured faster
            (:func:`choose_path`, :class:`PathTrial`); default :data:`MIN_FAST_WORK`. ``0`` takes the split on every
            call, unmeasured (with more than one thread).
        trial: the :class:`PathTrial` this lookup shares with the model's other lookups (:func:`install_cpu_lookup`
            gives them one); default: one of its own.

    Attributes:
        taken: calls per path so far, ``{"fast": n, "fbgemm": m}``; ``last``: the path of the latest call;
        trial: the :class:`PathTrial` of the calls above ``min_work``.

    Example::

        tbe.forward = CpuLookup(tbe, tbe.forward)   # what install_cpu_lookup does
    """

    def __init__(
        self,
        tbe: SplitTableBatchedEmbeddingBagsCodegen,
        fbgemm_forward: Callable[..., torch.Tensor],
        threads: int | None = None,
        min_work: int | None = None,
        trial: PathTrial | None = None,
    ) -> None:
        reason = ineligible_reason(tbe)
        if reason is not None:
            raise ValueError(f"CpuLookup: this TBE keeps FBGEMM's forward: {reason}")
        self.tbe = tbe
        self.fbgemm_forward = fbgemm_forward
        self.threads = max(1, threads or torch.get_num_threads())
        self.tables: list[int] = [int(t) for t in tbe.feature_table_map]
        self.weights = tbe.split_embedding_weights()  # per table, views of weights_host
        self.backward_op = getattr(torch.ops.fbgemm, _BACKWARD_OPS[tbe.optimizer.name]).default
        self.static = _arguments(tbe)
        self.names = [a.name for a in self.backward_op._schema.arguments]
        self.min_work = MIN_FAST_WORK if min_work is None else min_work
        self.mean_dim = int(tbe.D_offsets[-1]) / max(1, len(self.tables))
        self.taken = {FAST: 0, FBGEMM: 0}
        self.last: str | None = None
        self.trial = trial if trial is not None else PathTrial()

    def path(self, ids: int) -> str:
        """The path a call with ``ids`` ids may take (:func:`choose_path` with this lookup's dims and threads)."""
        return choose_path(ids, self.mean_dim, self.threads, self.min_work)

    def __call__(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        feature_requires_grad: torch.Tensor | None = None,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        path = self.path(indices.numel())
        if path == FAST and self.min_work:  # measured: training calls time the paths, the others follow the choice
            if torch.is_grad_enabled():
                path = self.trial.for_call(self, time.perf_counter())
                if path == FBGEMM and self.trial.leads(self):
                    release_threads()  # FBGEMM's path is timed and run as it is without the split: no pool
            else:
                path = self.trial.chosen or FBGEMM
        if path == FBGEMM or batch_size_per_feature_per_rank is not None or any(v is not None for v in kwargs.values()):
            self.taken[FBGEMM] += 1
            self.last = FBGEMM
            return self.fbgemm_forward(
                indices, offsets, per_sample_weights, feature_requires_grad, batch_size_per_feature_per_rank, **kwargs
            )
        # FBGEMM's input preparation: dtype casts and its bounds check (bounds_check_mode), as its forward does.
        indices, offsets, per_sample_weights, _ = self.tbe.prepare_inputs(
            indices, offsets, per_sample_weights, None, force_cast_input_types=True, prefetch_pipeline=False
        )
        self.tbe.step += 1
        self.taken[FAST] += 1
        self.last = FAST
        return _Lookup.apply(
            self.tbe.placeholder_autograd_tensor, per_sample_weights, self, indices, offsets, feature_requires_grad
        )

    def enable(self, on: bool = True) -> None:
        """Route the TBE's calls through this lookup (``on``) or back to FBGEMM's own forward (same bits either way;
        off, the split's threads are stopped: :func:`release_threads`)."""
        if on:
            _compat.patch_method(self.tbe, "forward", self)
        else:
            _compat.unpatch_method(self.tbe, "forward")
            release_threads()

    def pooled(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[int]]:
        """The pooled output ``[B, total_D]`` and each feature's first id (``T + 1`` bounds): one ``embedding_bag``
        per feature, concatenated. (One call over all tables, the bags reordered sample-major so that its output is
        ``[B, T x D]`` without the concatenation, was slower: moving the ids cost more than the copy it saved.)"""
        T = len(self.tables)
        B = (offsets.numel() - 1) // T
        bounds = offsets[::B].tolist() if B else [0] * (T + 1)  # on the host already: no device sync
        outs = []
        for f, t in enumerate(self.tables):
            s, e = bounds[f], bounds[f + 1]
            bag_offsets = offsets[f * B : (f + 1) * B + 1]
            outs.append(
                F.embedding_bag(
                    indices[s:e],
                    self.weights[t],
                    bag_offsets - s if s else bag_offsets,
                    mode="sum",
                    include_last_offset=True,
                    per_sample_weights=None if weights is None else weights[s:e],
                )
            )
        return torch.cat(outs, dim=1), bounds

    def update(
        self,
        grad: torch.Tensor,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor,
        bounds: Sequence[int],
    ) -> None:
        """FBGEMM's fused backward + update, one call per group of tables, the groups on separate threads."""
        if not bounds[-1]:
            return  # no ids, no row to update (what FBGEMM's call would do too)
        groups = self._groups(bounds)
        if len(groups) == 1:
            self._call(grad, indices, offsets, weights)
            return
        T = len(self.tables)
        lengths = (offsets[1:] - offsets[:-1]).view(T, -1)
        calls = []
        for features in groups:
            keep = torch.zeros(T, 1, dtype=lengths.dtype)
            keep[features] = 1
            sub_offsets = torch.zeros(offsets.numel(), dtype=offsets.dtype)
            torch.cumsum((lengths * keep).view(-1), 0, out=sub_offsets[1:])
            sub_indices = torch.cat([indices[bounds[f] : bounds[f + 1]] for f in features])
            sub_weights = (
                torch.cat([weights[bounds[f] : bounds[f + 1]] for f in features]) if weights.numel() else weights
            )
            calls.append((sub_indices, sub_offsets, sub_weights))
        run_on_threads(self._call, [(grad, *call) for call in calls])

    def _groups(self, bounds: Sequence[int]) -> list[list[int]]:
        # Features of one table stay together (their rows are one memory); tables go to the lightest group by ids.
        by_table: dict[int, list[int]] = {}
        for f, t in enumerate(self.tables):
            by_table.setdefault(t, []).append(f)
        n = min(self.threads, len(by_table))
        if n <= 1:
            return [list(range(len(self.tables)))]
        load = [0] * n
        groups: list[list[int]] = [[] for _ in range(n)]
        sized = sorted(by_table.values(), key=lambda fs: -sum(bounds[f + 1] - bounds[f] for f in fs))
        for features in sized:
            g = load.index(min(load))
            groups[g].extend(features)
            load[g] += sum(bounds[f + 1] - bounds[f] for f in features)
        return [sorted(g) for g in groups if g]

    def _call(self, grad: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor) -> None:
        args = dict(self.static, grad_output=grad, indices=indices, offsets=offsets, indice_weights=weights)
        with torch.no_grad():  # grad mode is per thread; the op updates the weights in place
            self.backward_op(*[args[n] for n in self.names])


class _Lookup(torch.autograd.Function):
    """Forward: :meth:`CpuLookup.pooled`; backward: :meth:`CpuLookup.update` (the fused update, nothing returned for
    the tables) and, for learnt per-sample weights, FBGEMM's own gradient of them."""

    @staticmethod
    def forward(
        ctx: Any,
        placeholder: torch.Tensor,
        weights: torch.Tensor | None,
        lookup: CpuLookup,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        feature_requires_grad: torch.Tensor | None,
    ) -> torch.Tensor:
        out, bounds = lookup.pooled(indices, offsets, weights)
        empty = torch.empty(0)
        ctx.lookup, ctx.bounds = lookup, bounds
        ctx.save_for_backward(
            indices,
            offsets,
            empty if weights is None else weights,
            empty if feature_requires_grad is None else feature_requires_grad,
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        indices, offsets, weights, feature_requires_grad = ctx.saved_tensors
        lookup: CpuLookup = ctx.lookup
        grad = grad.contiguous()
        args = lookup.tbe.optimizer_args
        clipped = grad.clamp(-args.max_gradient, args.max_gradient) if args.gradient_clipping else grad
        # FBGEMM's (1.8) autograd takes the weights' gradient from the rows before they are updated.
        grad_weights = None
        if ctx.needs_input_grad[1]:
            if not feature_requires_grad.numel():  # FBGEMM's "undefined": every feature's weights learn
                feature_requires_grad = torch.ones(len(lookup.tables), dtype=torch.int32)
            grad_weights = torch.ops.fbgemm.split_embedding_codegen_grad_indice_weights_cpu(
                grad,
                lookup.tbe.weights_host,
                lookup.tbe.weights_offsets,
                lookup.tbe.D_offsets,
                indices,
                offsets,
                feature_requires_grad,
            )
        lookup.update(clipped, indices, offsets, weights, ctx.bounds)
        return None, grad_weights, None, None, None, None


def install_cpu_lookup(model: nn.Module, threads: int | None = None) -> dict[str, str]:
    """Give every CPU fused TBE in a sharded ``model`` the faster forward (see the module docstring).

    With one intra-op thread (``threads``, default ``torch.get_num_threads()``: a rank per core, say) nothing is
    installed: the backward has nothing to split and torch's forward, plus its concatenation, is no faster than
    FBGEMM's (BENCHMARKS.md, "The CPU step against the sparse peer"). Where it is installed, each call still takes
    FBGEMM's path when its work is below :data:`MIN_FAST_WORK` (:func:`choose_path`); above it the model's lookups
    share one :class:`PathTrial`.

    Args:
        model: a ``DistributedModelParallel`` (or any module holding TorchRec sharded embedding modules).
        threads: the threads the lookups may use.

    Returns:
        ``{"<sharded module>/<kernel index>": "fast" or the reason it kept FBGEMM's forward}``.

    Example::

        dmp = DistributedModelParallel(model, device=torch.device("cpu"), ...)
        install_cpu_lookup(dmp)    # {'tables/0.0': 'fast'}
    """
    threads = threads or torch.get_num_threads()
    done: dict[str, str] = {}
    trial = PathTrial()  # one for the model: its steps run on one path (the split's threads are the process's)
    for where, tbe in _compat.fused_tbes(model):
        if isinstance(tbe.forward, CpuLookup):
            done[where] = "fast"
            continue
        reason = ineligible_reason(tbe) or (None if threads > 1 else "one intra-op thread")
        if reason is None:
            CpuLookup(tbe, tbe.forward, threads=threads, trial=trial).enable()
        done[where] = reason or "fast"
    return done


def cpu_lookups(model: nn.Module) -> list[CpuLookup]:
    """The CPU lookups enabled on ``model``'s TBEs (keep them to switch each off and on with :meth:`CpuLookup.enable`)."""
    return [tbe.forward for _, tbe in _compat.fused_tbes(model) if isinstance(tbe.forward, CpuLookup)]
