"""When a rank fails, the others stop quickly and say why.

A sharded job is only as alive as its least alive rank: every step's input and output all-to-alls need all of
them. What happens when one rank dies or raises:

* its process exits, its sockets close, and the other ranks' next (or current) collective fails at once with
  a transport error (gloo: ``Connection closed by peer``; NCCL: an asynchronous error that aborts the
  communicator);
* a rank that hangs instead (deadlocked, stopped, its host gone without closing connections) is detected by the
  collective timeout, which :class:`~lightning_rec.RecShardStrategy` sets to 5 minutes by default (its
  ``timeout`` argument), not the 30 minutes of Lightning's default.

Either way the surviving ranks raise a transport error that says nothing about the cause. :class:`FailureBoard`
fixes that: a rank that fails for a reason of its own (a bad batch, a NaN loss, a bug) writes its error into the
process group's key-value store before it exits, and a rank whose collective then fails reads it back and adds it
to its own error (:func:`explain`), with where training was and what to do next.

A job that finished must also *exit* cleanly: :func:`close_process_group_at_exit` waits for the other ranks and
tears the process group down before the interpreter does (see its docstring for the crash it prevents).
"""

from __future__ import annotations

import atexit
import errno
import logging
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_rec import _compat
from lightning_rec.errors import InputError, NonFiniteError

__all__ = [
    "FailureBoard",
    "close_process_group_at_exit",
    "collective_mismatch",
    "describe_position",
    "disk_full",
    "explain",
    "explain_mismatch",
    "is_communication_error",
    "note_failure",
]

log = logging.getLogger(__name__)

# What transport failures look like when torch does not raise a DistError subclass (gloo raises RuntimeError).
_TRANSPORT_MARKERS = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out waiting",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL",
    "ProcessGroupGloo",
    "Broken pipe",
)
# What a collective says when the tensors the ranks gave it do not fit together: gloo checks each rank's tensors
# against the sizes it expects before sending (`ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected
# (4, 24), got (5, 24))`), and its transport stops a peer that sends more than was expected (`op.preamble.length <=
# op.nbytes`); torch checks an all-gather's output against the world size. Every rank is alive: the cause is what a rank
# sent, not a lost rank.
_MISMATCH_MARKERS = (
    "invalid tensor size",
    "invalid tensor shape",
    "op.preamble.length <= op.nbytes",
    "must be equal to world_size times input tensor size",
    "Tensor list mustn't be larger",
)
_MAX_MESSAGE = 4000


def close_process_group_at_exit(timeout: timedelta | None = None) -> None:
    """Make the process end cleanly after a finished job: at interpreter exit, wait for the other ranks, hold the
    last collective's work object, and destroy the default process group (idempotent; the latest ``timeout`` wins).

    Why: each gloo worker thread destroys the collective it just ran, and that object holds Python references
    (torch's thread-local state). If the interpreter is already finalizing when a worker does so (the main thread
    returned right after its last collective), the worker cannot take the GIL, is unwound inside a ``noexcept``
    destructor, and the process aborts with ``terminate called without an active exception`` (exit code 134): a
    finished job that crashed at exit in ~1 of 13 two-process fits here, and in 1 of 3 plain 2-rank gloo scripts.
    ``destroy_process_group`` alone does not help while DDP and TorchRec's modules still reference the group (its
    threads keep running). A barrier does: it holds every collective still in flight, so when Python holds the
    barrier, the main thread destroys them all, at exit, with the GIL.

    After a failure (:func:`note_failure`, called by the strategy's ``on_exception``) there is no barrier: the
    other ranks may never reach it.
    """
    _EXIT.timeout = timeout or _EXIT.timeout
    atexit.unregister(_EXIT)  # registered once, however many trainers a script builds
    atexit.register(_EXIT)


def note_failure() -> None:
    """This process is failing: its exit must not wait for the other ranks (see :func:`close_process_group_at_exit`)."""
    _EXIT.failed = True


class _CleanExit:
    """The exit handler of :func:`close_process_group_at_exit`. One per process, because ``atexit`` and the default
    process group are per process."""

    def __init__(self) -> None:
        self.timeout = timedelta(minutes=5)
        self.failed = False
        self.held: Any = None  # the final barrier's work: destroyed by the main thread, at finalization

    def __call__(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        try:
            if not self.failed:
                self.held = dist.barrier(async_op=True)
                self.held.wait(self.timeout)
            dist.destroy_process_group()
        except Exception as err:  # noqa: BLE001 - exiting anyway: a peer already gone is not this job's error
            log.debug("lightning_rec: closing the process group at exit: %s", err)


_EXIT = _CleanExit()


def is_communication_error(exception: BaseException) -> bool:
    """Whether ``exception`` (or what caused it) is a failed collective or store operation, i.e. a consequence
    of another rank's failure rather than a cause of its own.

    Example::

        >>> is_communication_error(RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
        True
        >>> is_communication_error(ValueError("bad id"))
        False
    """
    seen = set()
    current: BaseException | None = exception
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, dist.DistError):
            return True
        if isinstance(current, RuntimeError) and any(m in str(current) for m in _TRANSPORT_MARKERS):
            return True
        current = current.__cause__ or current.__context__
    return False


def disk_full(exception: BaseException) -> str | None:
    """One line saying that a disk filled up, if that is what stopped the rank (in ``exception`` or what caused it),
    else ``None``: a failed checkpoint save's own line (which file, what it needs and what is free), or the full
    file's name. Said before the traceback, which for a save runs to ~300 lines (each rank's, inside
    ``torch.distributed.checkpoint``'s error), with the cause at its very end.

    Example::

        >>> disk_full(OSError(errno.ENOSPC, "No space left on device", "runs/x/metrics.csv"))
        'no space left on device writing runs/x/metrics.csv; free some space, or write elsewhere, then resume with `--ckpt_path=last`'
        >>> disk_full(ValueError("bad id")) is None
        True
    """
    hint = "; free some space, or write elsewhere, then resume with `--ckpt_path=last`"
    seen: set[int] = set()
    todo: list[BaseException] = [exception]
    found: OSError | None = None
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for line in str(current).splitlines():
            if "no space left on device writing" in line:  # the checkpoint save's line (lightning_rec.checkpoint)
                return line.strip().removeprefix("- ") + hint
        if found is None and isinstance(current, OSError) and current.errno == errno.ENOSPC:
            found = current
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
    if found is None:
        return None
    return f"no space left on device writing {found.filename or 'a file'}{hint}"


def collective_mismatch(exception: BaseException) -> str | None:
    """The message of the collective error in ``exception`` (or what caused it) that says the ranks' tensors do not
    fit together (sizes or shapes that differ where the collective needs them equal), or ``None``.

    Example::

        >>> collective_mismatch(RuntimeError("ProcessGroupGloo::allgather: invalid tensor size at index 0 "
        ...                                  "(expected (4, 24), got (5, 24))"))
        'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (4, 24), got (5, 24))'
        >>> collective_mismatch(RuntimeError("Connection closed by peer")) is None
        True
    """
    seen = set()
    current: BaseException | None = exception
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current).strip()
        if any(m in text for m in _MISMATCH_MARKERS):
            return text.splitlines()[0] if text else type(current).__name__
        current = current.__cause__ or current.__context__
    return None


def explain_mismatch(detail: str) -> str:
    """What a rank says of a collective that failed because the ranks' tensors do not fit together (see
    :func:`collective_mismatch`): what the collective said, and the likely cause. No rank was lost.

    Example::

        >>> print(explain_mismatch("ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (4, 24), "
        ...                        "got (5, 24))"))
        a collective operation failed because the ranks gave it tensors whose sizes differ where it needs them equal: ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (4, 24), got (5, 24)). ...
    """
    return (
        "a collective operation failed because the ranks gave it tensors whose sizes differ where it needs them equal: "
        f"{detail}. No rank was lost: this is what the ranks sent. Likely cause: a tensor whose size depends on the "
        "rank's data (e.g. its batch size) gathered or reduced with `dist.all_gather`/`all_reduce` or "
        "`self.all_gather` in the model, a callback or a metric. HINT: gather the sizes first and pad to the largest, "
        "or reduce per-rank sums and counts instead of per-sample tensors."
    )


class FailureBoard:
    """Ranks tell each other why they stopped, through the process group's key-value store.

    The store is served by the rank-0 process (or by torchrun's agent) from a background thread, so it answers
    while that rank's main thread is blocked in a collective. Keys live under a prefix that every rank of one
    run shares (``token``), so a failure in an earlier run of the same process group is never reported again.

    Args:
        store: a ``torch.distributed.Store`` (normally the default process group's).
        token: the run's prefix, the same on every rank.
        rank: this process's global rank.

    Example::

        board = FailureBoard.for_default_group(token, rank)
        board.publish("ValueError at training step 3: ...")   # on the rank that failed first
        board.first()                                          # on the others: (3, "ValueError ...")
    """

    def __init__(self, store: dist.Store, token: str, rank: int) -> None:
        self._store = dist.PrefixStore(f"lightning_rec/failures/{token}/", store)
        self.rank = rank

    @classmethod
    def for_default_group(cls, token: str, rank: int) -> FailureBoard | None:
        """The board on the default process group's store (``None`` without a process group)."""
        store = _compat.default_store()
        return None if store is None else cls(store, token, rank)

    def publish(self, message: str) -> None:
        """Record this rank's error; the first rank to publish is the one :meth:`first` reports. Never raises."""
        try:
            self._store.set(f"rank{self.rank}", message[:_MAX_MESSAGE])
            self._store.compare_set("first", "", str(self.rank))
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0; the error itself still propagates
            log.debug("could not publish a failure", exc_info=True)

    def handle(
        self,
        exception: BaseException,
        position: str,
        world_size: int,
        timeout: timedelta | None,
        owner: str = "RecShardStrategy",
    ) -> None:
        """What a rank does with the exception that stops it: publish it if it is its own, or, if a collective failed
        (a consequence of another rank's failure), log :func:`explain`'s message and attach it to the exception. A
        full disk is said at once, in one line (:func:`disk_full`), before the exception's traceback."""
        full = disk_full(exception)
        if full is not None:
            print(f"[rank {self.rank}] {owner}: {full}", file=sys.stderr, flush=True)
        detail = collective_mismatch(exception)
        if detail is not None:  # every rank raises it (gloo checks sizes on each): its own error, no rank was lost
            where = f" at {position}" if position else ""
            self.publish(f"{type(exception).__name__}{where}: {explain_mismatch(detail)}")
            message = f"{owner}: rank {self.rank} of {world_size} stopped{where}: {explain_mismatch(detail)}"
            log.error(message)
            if hasattr(exception, "add_note"):
                exception.add_note(message)
            return
        if not is_communication_error(exception):
            # The input checks' errors say where they happened themselves.
            named = isinstance(exception, (InputError, NonFiniteError))
            where = f" at {position}" if position and not named else ""
            self.publish(f"{type(exception).__name__}{where}: {exception}")
            return
        message = explain(self.rank, world_size, position, self.first(), timeout, owner)
        log.error(message)
        if hasattr(exception, "add_note"):  # Python >= 3.11: shown under the transport error's own message
            exception.add_note(message)

    def first(self) -> tuple[int, str] | None:
        """``(rank, message)`` of the first rank that published an error, or ``None``. Never blocks, never raises."""
        try:
            if not self._store.check(["first"]):  # `get` of a missing key would wait for it
                return None
            rank = int(self._store.get("first"))
            return rank, self._store.get(f"rank{rank}").decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store is served by rank 0's process, which may be the one that died
            return None


def explain(
    rank: int,
    world_size: int,
    position: str,
    first: tuple[int, str] | None,
    timeout: timedelta | None,
    owner: str = "RecShardStrategy",
) -> str:
    """The message of a rank whose collective failed because another rank failed or stopped answering.

    Args:
        rank: this rank. world_size: the number of ranks.
        position: where training was (see :func:`describe_position`).
        first: what :meth:`FailureBoard.first` returned.
        timeout: the collective timeout.

    Example::

        >>> print(explain(0, 2, "training step 7", (1, "ValueError: bad id"), timedelta(minutes=5)))
        RecShardStrategy: rank 0 of 2 stopped at training step 7: a collective operation failed because rank 1 failed first: ValueError: bad id
        The steps since the last checkpoint are lost, nothing before it: ...
    """
    where = f" at {position}" if position else ""
    if first is not None and first[0] != rank:
        cause = f"because rank {first[0]} failed first: {first[1]}"
    else:
        cause = (
            "and no rank reported an error of its own: a rank was most likely killed (out of memory, preempted, "
            "SIGKILL), was aborted by its collective library (gloo aborts a rank whose peer sent more than it expected: "
            "that rank's log then says 'collective mismatch'), lost its network, or stopped answering for longer than the collective timeout "
            f"({timeout if timeout is not None else 'default'}; `{owner}(timeout=...)`). Check the other ranks' logs "
            "and the launcher's or scheduler's"
        )
    return (
        f"{owner}: rank {rank} of {world_size} stopped{where}: a collective operation failed {cause}\n"
        "The steps since the last checkpoint are lost, nothing before it: once the cause is fixed, resume with "
        "`trainer.fit(model, ..., ckpt_path='last')` (or the checkpoint's path)."
    )


def describe_position(trainer: Any, ahead: int = 0, transferring: bool = False, batch: int | None = None) -> str:
    """Where ``trainer`` is, for error messages: ``"training step 12 (epoch 0, batch 12)"``,
    ``"validation batch 3"``, ...

    Args:
        trainer: the Lightning Trainer.
        ahead: the batch in question is that many batches after the current one.
        transferring: called while the batch is moved to the device, before Lightning counts it.
        batch: the batch in question is this one of the current training epoch (e.g. one a pipelined loader
            fetches ahead of Lightning); overrides ``ahead`` and ``transferring``.

    The step is Lightning's ``global_step`` (optimizer steps done before this one: the ``step`` its loggers use);
    batches count from 0 in their epoch or loop.
    """
    ahead_batches = ahead + int(transferring)
    from lightning.pytorch.trainer.states import RunningStage

    stage = trainer.state.stage
    if stage == RunningStage.TRAINING:
        started = _compat.training_batch_idx(trainer) + 1  # batches of this epoch handed to the device so far
        if batch is not None:
            ahead, ahead_batches = batch - started, batch - started + 1
        batch = _compat.training_batch_idx(trainer) + ahead_batches
        return f"training step {trainer.global_step + ahead} (epoch {trainer.current_epoch}, batch {batch})"
    loops = {
        RunningStage.SANITY_CHECKING: ("sanity-check validation", _compat.fit_validation_loop(trainer)),
        RunningStage.VALIDATING: (
            "validation",
            _compat.fit_validation_loop(trainer)
            if trainer.training or trainer.state.fn == "fit"
            else trainer.validate_loop,
        ),
        RunningStage.TESTING: ("test", trainer.test_loop),
        RunningStage.PREDICTING: ("predict", trainer.predict_loop),
    }
    if stage not in loops:
        return f"{stage.value}" if stage is not None else ""
    name, loop = loops[stage]
    return f"{name} batch {_compat.batches_fetched(loop) - 1 + ahead_batches}"
