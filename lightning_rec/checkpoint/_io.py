"""Saving and loading a sharded checkpoint directory: what :class:`~lightning_rec.RecShardStrategy`'s
``save_checkpoint``/``load_checkpoint``/``remove_checkpoint`` hand over, and the run metadata stored beside the
tensors (``checkpoint["lightning_rec"]``: the module's class, the sharding plan, the world size and the embedding
optimizer it was saved with).

Every rank calls :func:`save` and :func:`load`; each writes and reads only its own shards through
``torch.distributed.checkpoint``, rank 0 alone writes ``meta.pt`` and the manifest (see
:mod:`~lightning_rec.checkpoint._layout`). This module knows nothing of the strategy: it receives the module, its
optimizers (:class:`~lightning_rec.checkpoint._optimizer_state.ComposedOptimizer` for the strategy's own) and what
the module was sharded with (:class:`ShardingRecord`).

Example::

    save(checkpoint, Path("epoch=0.ckpt"), module=module, sharding=state)   # every rank
    meta = load(Path("epoch=0.ckpt"), module, optimizers, owner="RecShardStrategy")
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_rec import _compat
from lightning_rec.checkpoint import _layout as layout
from lightning_rec.checkpoint import _safe_io as safe_io
from lightning_rec.checkpoint._collisions import CollisionReload
from lightning_rec.checkpoint._optimizer_state import OptimizerTarget, is_tensor
from lightning_rec.config import EmbeddingOptimizer
from lightning_rec.errors import CheckpointError, CheckpointReplacedError, UnsafeCheckpointError

MODEL_PREFIX, OPTIM_PREFIX = layout.MODEL_PREFIX, layout.OPTIM_PREFIX


class _PlanDocument(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


class ShardingRecord(Protocol):
    """What a sharded module was sharded with, as a checkpoint records it (the strategy's ``ShardedState`` is one)."""

    @property
    def embedding_optimizer(self) -> EmbeddingOptimizer:
        """The fused optimizer baked into the tables' kernels."""
        ...

    @property
    def report(self) -> _PlanDocument | None:
        """The sharding-plan report (``to_dict()``: its JSON document), if one was built."""
        ...


def run_info(module: nn.Module, sharding: ShardingRecord | None, world_size: int) -> dict[str, Any]:
    """The run metadata a checkpoint stores as ``checkpoint["lightning_rec"]``: the module's class (what the inference
    export rebuilds when not told, :mod:`lightning_rec.serving`), and, for a sharded module, its embedding optimizer
    and plan; the world size it was saved on (what :func:`load` compares to say it resharded)."""
    info: dict[str, Any] = {"module_class": f"{type(module).__module__}.{type(module).__qualname__}"}
    if sharding is not None:
        info["embedding_optimizer"] = sharding.embedding_optimizer.as_dict()
        if sharding.report is not None:
            info["plan"] = sharding.report.to_dict()
    info["world_size"] = world_size
    return info


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a complete checkpoint directory (it has the ``COMPLETE`` marker)."""
    try:
        layout.read_manifest(Path(path))
        return True
    except CheckpointError:
        return False


class _Collectives:
    """The few collectives save/load need, or single-process stand-ins when no process group runs."""

    def __init__(self) -> None:
        self.on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.on else 0
        self.world_size = dist.get_world_size() if self.on else 1

    def barrier(self) -> None:
        if self.on:
            dist.barrier()

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.on:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def raise_if_any(self, problems: list[str], headline: str) -> None:
        """Every rank raises the same error if any rank found a problem (no rank is left waiting)."""
        everything = sorted({p for rank_problems in self.all_gather(problems) for p in rank_problems})
        if everything:
            raise CheckpointError(headline + "\n  - " + "\n  - ".join(everything))


# -----------------------------------------------------------------------------------------------------------
# Save
# -----------------------------------------------------------------------------------------------------------


def _split(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint dict -> (flat tensors for DCP, tensor-free rest for ``meta.pt``)."""
    tensors: dict[str, Any] = {}
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    meta["model_extra"] = {}
    for key, value in checkpoint.get("state_dict", {}).items():
        if is_tensor(value):
            tensors[MODEL_PREFIX + key] = value
        else:
            meta["model_extra"][key] = value
    meta["optimizer_states"] = []
    for i, opt_state in enumerate(checkpoint.get("optimizer_states", [])):
        rest = {k: v for k, v in opt_state.items() if k != "state"}
        rest["extra"] = {}
        for fqn, entries in opt_state.get("state", {}).items():
            for name, value in entries.items():
                if is_tensor(value):
                    tensors[f"{OPTIM_PREFIX}{i}/{fqn}/{name}"] = value
                else:
                    rest["extra"].setdefault(fqn, {})[name] = value
        meta["optimizer_states"].append(rest)
    return tensors, meta


def save(
    checkpoint: Mapping[str, Any],
    path: Path,
    *,
    module: nn.Module,
    sharding: ShardingRecord | None = None,
    run: str | None = None,
) -> None:
    """Write Lightning's ``checkpoint`` dict as the checkpoint directory ``path`` (every rank calls this).

    A save that fails on any rank fails on every rank with the same :class:`CheckpointError`, naming each rank's
    cause (a full disk as "no space left on device writing <checkpoint> (needs ~X MB, Y MB free)"); its staging
    directory is removed and an earlier checkpoint at ``path`` stays as it was.

    Args:
        checkpoint: what ``trainer._checkpoint_connector.dump_checkpoint()`` produced, with optimizer states
            from :func:`~lightning_rec.checkpoint._optimizer_state.canonical_state`.
        path: the directory to create (an existing checkpoint there is replaced once the new one is complete).
        module: the LightningModule saved (its class is recorded, see :func:`run_info`).
        sharding: what ``module`` was sharded with (``None``: not sharded); recorded with the world size.
        run: the name of the run saving it (:mod:`lightning_rec._strategy.run_identity`), recorded in the manifest:
            what ``ckpt_path="last"`` compares before resuming from it.
    """
    path = Path(path)
    comm = _Collectives()
    staging = layout.staging_path(path)
    tensors, meta = _split(checkpoint)
    meta["lightning_rec"] = run_info(module, sharding, comm.world_size)
    error: BaseException | None = None
    if comm.rank == 0:
        try:
            layout.remove_tree(staging)  # left by a crashed save
            staging.mkdir(parents=True)
        except OSError as err:
            error = err
    _raise_if_failed(comm, error, path, staging, tensors)
    files: dict[str, Any] = {}
    try:
        # One file per tensor chunk: DCP keeps every tensor it writes to a file alive until that file is closed
        # (and clones views of the kernels' flat weight buffers), so one file per rank would peak at the whole
        # local state. DCP gathers every rank's failure and raises it on all of them.
        writer = dcp.FileSystemWriter(staging, single_file_per_rank=False, sync_files=True)
        dcp.save(tensors, storage_writer=writer, no_dist=not comm.on)
        files = {p.name: layout.file_digest(p) for p in layout.own_files(staging, comm.rank)}
    except (Exception, CheckpointException) as err:
        error = err
    _raise_if_failed(comm, error, path, staging, tensors)
    all_files = {k: v for rank_files in comm.all_gather(files) for k, v in rank_files.items()}
    if comm.rank == 0:
        try:
            _publish(staging, path, meta, all_files, comm.world_size, run)
        except (OSError, RuntimeError) as err:
            error = err
    _raise_if_failed(comm, error, path, staging, tensors)


def _publish(
    staging: Path, path: Path, meta: dict[str, Any], files: dict[str, Any], world_size: int, run: str | None
) -> None:
    """Rank 0's part: ``meta.pt``, the manifest, then the directory made visible as ``path``."""
    layout.write_file(staging / layout.META_FILE, safe_io.dumps_meta(meta))
    for name in (layout.META_FILE, layout.METADATA_FILE):
        files[name] = layout.file_digest(staging / name)
    referenced = {s.relative_path for s in safe_io.read_metadata(staging).storage_data.values()}
    if not referenced <= set(files):
        raise CheckpointError(f"DCP wrote files no rank accounted for: {sorted(referenced - set(files))}")
    info = {"world_size": world_size, "global_step": int(meta.get("global_step", 0)), "epoch": meta.get("epoch")}
    if run is not None:
        info["run"] = run
    layout.mark_complete(staging, files, info)
    layout.publish(staging, path)


def _bytes_written(tensors: Mapping[str, Any], rank: int) -> int:
    """About how many bytes this rank writes: its shards, and (rank 0) the tensors every rank holds whole."""
    total = 0
    for value in tensors.values():
        if isinstance(value, _compat.ShardedTensor):
            total += sum(s.tensor.numel() * s.tensor.element_size() for s in value.local_shards())
        elif isinstance(value, DTensor):
            local = value.to_local()
            total += local.numel() * local.element_size()
        elif rank == 0 and isinstance(value, Tensor):
            total += value.numel() * value.element_size()
    return total


def _causes(error: BaseException) -> list[BaseException]:
    """``error``, what caused it, and what each rank raised inside a DCP ``CheckpointException``."""
    seen: list[BaseException] = []
    todo = [error]
    while todo:
        err = todo.pop()
        if err in seen:
            continue
        seen.append(err)
        if isinstance(err, CheckpointException):
            todo += [exc for exc, _ in err.failures.values()]
        todo += [e for e in (err.__cause__, err.__context__) if e is not None]
    return seen


def _out_of_space(error: BaseException) -> bool:
    # torch's zip writer reports a short write as "unexpected pos" rather than the OSError behind it.
    return any(
        (isinstance(e, OSError) and e.errno == errno.ENOSPC)
        or "No space left on device" in str(e)
        or "unexpected pos" in str(e)
        for e in _causes(error)
    )


def _free_bytes(path: Path) -> int | None:
    for folder in (path, *path.parents):
        if folder.is_dir():
            return shutil.disk_usage(folder).free
    return None


def _failure(error: BaseException, path: Path) -> tuple[bool, str]:
    """``(out of space, what to say)`` of this rank's failure: its free space, or its cause in one line."""
    if _out_of_space(error):
        free = _free_bytes(path.parent)
        return True, f"{free / 2**20:.1f} MB free" if free is not None else "free space unknown"
    if isinstance(error, CheckpointException):  # what this rank's failure was, without DCP's tracebacks
        error = next((e for e in _causes(error) if not isinstance(e, CheckpointException)), error)
    return False, f"{type(error).__name__}: {error}".splitlines()[0]


def _raise_if_failed(
    comm: _Collectives, error: BaseException | None, path: Path, staging: Path, tensors: Mapping[str, Any]
) -> None:
    """Every rank raises one error naming each rank's cause if any rank failed (rank 0 first removes the staging
    directory, freeing what the save had written); what the save needs is summed over the ranks only then."""
    failures = comm.all_gather(None if error is None else _failure(error, path))
    if not any(failures):
        return
    need = sum(comm.all_gather(_bytes_written(tensors, comm.rank))) / 2**20
    reasons = [
        f"no space left on device writing {path} (needs ~{need:.1f} MB, {text})" if space else text
        for space, text in (f or (False, "") for f in failures)
    ]
    if comm.rank == 0:
        with contextlib.suppress(OSError):
            layout.remove_tree(staging)
    summary = "\n  - ".join(f"rank {r}: {reason}" for r, reason in enumerate(reasons) if reason)
    cause = f"Saving checkpoint {str(path)!r} failed; the previous checkpoint there (if any) is unchanged:\n  - "
    raise CheckpointError(cause + summary) from error


def remove(path: Path) -> None:
    """Delete the checkpoint at ``path`` (rank 0 only): renamed aside first, so it never looks half there."""
    layout.remove_tree(Path(path))


# -----------------------------------------------------------------------------------------------------------
# Load
# -----------------------------------------------------------------------------------------------------------


def _saved_entries(metadata: Metadata) -> tuple[dict[str, TensorStorageMetadata], dict[int, dict[str, dict[str, Any]]]]:
    model: dict[str, TensorStorageMetadata] = {}
    optim: dict[int, dict[str, dict[str, Any]]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise UnsafeCheckpointError(f"{key}: a pickled object in the tensor data; this format never writes one")
        if key.startswith(MODEL_PREFIX):
            model[key[len(MODEL_PREFIX) :]] = md
        elif key.startswith(OPTIM_PREFIX):
            _, i, fqn, name = key.split("/", 3)
            optim.setdefault(int(i), {}).setdefault(fqn, {})[name] = (md.size, md.properties.dtype)
    return model, optim


def _column_widths(md: TensorStorageMetadata) -> list[int]:
    """Widths of a saved table's column shards, in column order."""
    if len(md.size) != 2:
        return []
    return [w for _, w in sorted({(c.offsets[1], c.sizes[1]) for c in md.chunks})]


def _model_problems(live: Mapping[str, Any], saved: Mapping[str, TensorStorageMetadata], strict: bool) -> list[str]:
    problems = []
    for key, value in live.items():
        if not is_tensor(value):
            continue
        if key not in saved:
            if strict:
                problems.append(f"{key}: in the model, missing from the checkpoint")
        elif tuple(saved[key].size) != tuple(value.size()):
            problems.append(
                f"{key}: shape {tuple(saved[key].size)} in the checkpoint, {tuple(value.size())} in the model"
            )
    if strict:
        problems += [f"{key}: in the checkpoint, not in the model" for key in saved if key not in live]
    return problems


def load(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    strict: bool = True,
    weights_only: bool | None = None,
    verify_hashes: bool = True,
    owner: str = "RecShardStrategy",
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``module`` and ``optimizers`` in place (every rank calls this).

    Nothing is modified until the whole checkpoint checked out: complete, every file's size (and SHA-256,
    each rank hashing its share), the tensor names and global shapes against the model and optimizers.

    Args:
        path: a checkpoint directory written by :func:`save`, on any world size or plan.
        module: the (sharded) LightningModule.
        optimizers: its optimizers (empty for validate/test/predict: only the weights are loaded).
        strict: whether tensors missing from the checkpoint, or in it but not in the model, are errors.
        weights_only: ``False`` lets ``meta.pt`` unpickle arbitrary objects (only for trusted checkpoints).
        verify_hashes: check every file's SHA-256 before loading (sizes are always checked).
        owner: who the note on a checkpoint resharded onto another world size names.

    Returns:
        Lightning's checkpoint dict without the tensors (loops, callbacks, schedulers, ``lightning_rec``).

    Raises:
        CheckpointError: incomplete, corrupt or mismatching checkpoint; the message lists every problem.
    """
    comm = _Collectives()
    path = Path(path)
    with _pin_on_every_rank(comm, path, verify_hashes) as pinned:
        return _load_pinned(pinned, path, module, optimizers, comm, strict, weights_only, owner)


_ATTEMPTS = 3  # reads of a checkpoint that a running job keeps replacing (``last.ckpt``)


@contextlib.contextmanager
def _pin_on_every_rank(comm: _Collectives, path: Path, verify_hashes: bool) -> Iterator[layout.Pinned]:
    """One save of ``path``, held open on every rank and verified there (see :func:`~._layout.pin`); the ranks
    compare what they hold and try again (all of them) if a publish replaced it in between."""
    for attempt in range(_ATTEMPTS):
        with contextlib.ExitStack() as stack:
            problems: list[str] = []
            identity: str | None = None
            try:
                pinned = stack.enter_context(layout.pin(path, last_try=attempt + 1 == _ATTEMPTS))
                identity = pinned.identity
                problems = layout.verify_files(pinned, comm.rank, comm.world_size, hashes=verify_hashes)
            except CheckpointReplacedError:
                identity = "replaced"
            except CheckpointError as err:
                problems = [str(err)]
            seen = comm.all_gather((identity, problems))
            identities = {i for i, _ in seen if i is not None}
            if "replaced" in identities or len(identities) > 1:
                if attempt + 1 < _ATTEMPTS:
                    continue
                raise layout.replaced_error(path)
            everything = sorted({p for _, rank_problems in seen for p in rank_problems})
            if everything:
                raise CheckpointError(
                    f"Cannot load checkpoint {str(path)!r}; nothing was modified:\n  - " + "\n  - ".join(everything)
                )
            yield pinned
            return
    raise AssertionError("unreachable")  # pragma: no cover


def _load_pinned(
    pinned: layout.Pinned,
    given: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    comm: _Collectives,
    strict: bool,
    weights_only: bool | None,
    owner: str,
) -> dict[str, Any]:
    path = pinned.path
    meta = safe_io.load_meta(pinned, weights_only)
    saved_model, saved_optim = _saved_entries(safe_io.read_metadata(pinned))
    live = module.state_dict()
    problems = _model_problems(live, saved_model, strict)
    targets: dict[str, Any] = {MODEL_PREFIX + k: v for k, v in live.items() if is_tensor(v) and k in saved_model}
    opt_targets: list[OptimizerTarget] = []
    saved_opt_meta = meta.get("optimizer_states", [])
    if optimizers:
        if not saved_opt_meta:
            problems.append(
                "the checkpoint has no optimizer state (saved with `save_weights_only=True`?), so training cannot "
                "resume from it. HINT: load its weights in `validate/test/predict`, or export it and load the "
                "state dict into a fresh model."
            )
        elif len(saved_opt_meta) != len(optimizers):
            problems.append(f"the checkpoint has {len(saved_opt_meta)} optimizer(s), the model {len(optimizers)}")
        else:
            widths = {k: _column_widths(md) for k, md in saved_model.items()}
            named = dict(module.named_parameters())
            for i, opt in enumerate(optimizers):
                target = OptimizerTarget(
                    opt,
                    named,
                    live,
                    saved_optim.get(i, {}),
                    saved_opt_meta[i].get("param_groups", []),
                    widths,
                    saved_extra=saved_opt_meta[i].get("extra"),
                )
                problems += [f"optimizer {i}: {p}" for p in target.problems]
                targets.update({f"{OPTIM_PREFIX}{i}/{fqn}/{name}": t for (fqn, name), t in target.tensors.items()})
                opt_targets.append(target)
    saved_world_size = meta.get("lightning_rec", {}).get("world_size")
    collisions = CollisionReload.check(
        module,
        live,
        saved_model,
        lambda whole: dcp.load(
            {MODEL_PREFIX + k: t for k, t in whole.items()},
            storage_reader=safe_io.SafeFileSystemReader(pinned),
            no_dist=not comm.on,
        ),
        comm.rank,
        comm.world_size,
        saved_world_size,
    )
    comm.raise_if_any(
        problems + collisions.problems,
        f"Checkpoint {str(path)!r} does not match {type(module).__name__} and its optimizers; nothing was modified:",
    )

    dcp.load(targets, storage_reader=safe_io.SafeFileSystemReader(pinned), no_dist=not comm.on)
    collisions.apply()
    if meta.get("model_extra"):
        module.load_state_dict(meta["model_extra"], strict=False)
    for i, target in enumerate(opt_targets):
        target.apply(saved_opt_meta[i].get("embedding_lrs"), int(meta.get("global_step", 0)))
    if saved_world_size not in (None, comm.world_size):
        rank_zero_info(f"{owner}: resharded checkpoint {given} from {saved_world_size} rank(s) onto {comm.world_size}.")
    return meta


def latest(folders: Sequence[Path]) -> tuple[Path | None, list[Path]]:
    """The newest complete checkpoint directly in ``folders`` (by when its ``COMPLETE`` manifest was written, as
    Lightning picks "last" by modification time), and the ``*.ckpt`` entries skipped as incomplete."""
    found: list[tuple[float, int, Path]] = []
    skipped: list[Path] = []
    for folder in folders:
        if not Path(folder).is_dir():
            continue
        for candidate in sorted(Path(folder).glob("*.ckpt")):
            try:
                manifest = layout.read_manifest(candidate)
                written = (candidate / layout.COMPLETE_FILE).stat().st_mtime
            except (CheckpointError, OSError):
                skipped.append(candidate)
                continue
            found.append((written, int(manifest.get("global_step", -1)), candidate))
    return (max(found)[2] if found else None), skipped
