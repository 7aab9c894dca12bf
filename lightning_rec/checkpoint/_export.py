"""Export: a sharded checkpoint -> one ordinary, unsharded state dict file, for inference and for people who
do not use this package; or straight into an unsharded LightningModule (:func:`load_module`, what
``RecLightningModule.load_from_checkpoint`` calls).

Example::

    from lightning_rec.checkpoint import export
    export("checkpoints/last.ckpt", "model.safetensors")            # or "model.pt" (torch.save, weights only)

    state = safetensors.torch.load_file("model.safetensors")        # or torch.load("model.pt", weights_only=True)
    model = MyModel(...)                                            # the plain, unsharded model
    model.load_state_dict(state, assign=True)                       # assign=True: tables built on "meta"

or from the shell: ``lightning-rec export checkpoints/last.ckpt model.safetensors``.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar, cast

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future
from torch.serialization import skip_data
from typing_extensions import override

from lightning_rec.checkpoint import _layout as layout
from lightning_rec.checkpoint import _safe_io as safe_io
from lightning_rec.errors import CheckpointReplacedError


def export(
    checkpoint: str | Path, output: str | Path, *, prefix: str = "", verify_hashes: bool = True
) -> dict[str, torch.Size]:
    """Write the model weights of a sharded checkpoint as one unsharded state dict file (one process, no GPU).

    Every table is assembled whole from its shards (so this needs memory for the whole model, once);
    optimizer state is left out.

    Args:
        checkpoint: a checkpoint directory written on any number of ranks with any plan.
        output: ``*.safetensors`` for safetensors, anything else for a ``torch.save`` file that loads with
            ``torch.load(..., weights_only=True)``. Written to a temporary name, then renamed.
        prefix: export only the weights under this prefix, without it: e.g. ``"model."`` gives the state dict of
            the ``nn.Module`` a LightningModule holds as ``self.model`` (``""``: everything).
        verify_hashes: check the checkpoint files' SHA-256 first.

    Returns:
        the exported names and shapes.

    Raises:
        CheckpointError: the checkpoint is incomplete or corrupt, or no weight is under ``prefix``.
    """
    path, output = Path(checkpoint), Path(output)
    state = with_pinned(path, lambda pinned: _assemble(pinned, prefix, verify_hashes))
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    if output.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(partial), metadata={"format": "pt", "source": str(path)})
    else:
        torch.save(state, partial)
    partial.replace(output)
    return {k: v.shape for k, v in state.items()}


def _assemble(
    pinned: layout.Pinned, prefix: str, verify_hashes: bool, into: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """Every model weight under ``prefix`` (without it) of the pinned checkpoint, whole, on CPU; read straight into
    the tensor of the same name, shape and dtype in ``into`` (a module's state dict: then no second copy of each table
    is held), else into a new one."""
    path = pinned.path
    problems = layout.verify_files(pinned, 0, 1, hashes=verify_hashes)
    if problems:
        raise layout.CheckpointError(f"Cannot read {str(path)!r}:\n  - " + "\n  - ".join(problems))
    metadata = safe_io.read_metadata(pinned)
    targets: dict[str, torch.Tensor] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(layout.MODEL_PREFIX + prefix) and isinstance(md, TensorStorageMetadata):
            live = (into or {}).get(key[len(layout.MODEL_PREFIX + prefix) :])
            if (
                isinstance(live, torch.Tensor)
                and type(live) in (torch.Tensor, torch.nn.Parameter)  # not a tensor subclass (ShardedTensor, ...)
                and live.device.type == "cpu"
                and live.shape == md.size
                and live.dtype == md.properties.dtype
                and live.is_contiguous()
            ):
                targets[key] = live.detach()
            else:
                targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
    if not targets:
        raise layout.CheckpointError(f"{str(path)!r} has no model weights under prefix {prefix!r}.")
    # Every tensor listed is checked to be stored whole when .metadata is read (safe_io.check_storage), and a stored
    # tensor that cannot be read raises naming it (_InPlaceReader): an export never leaves one out.
    try:
        dcp.load(targets, storage_reader=_InPlaceReader(pinned), no_dist=True)
    except CheckpointException as err:  # DCP wraps what the reader raised: the message naming the tensor, alone
        named = [e for e, _ in err.failures.values() if isinstance(e, layout.CheckpointError)]
        if named:
            raise named[0] from None
        raise
    return {key[len(layout.MODEL_PREFIX + prefix) :]: tensor.contiguous() for key, tensor in targets.items()}


_CHUNK = 1 << 24  # bytes a stored tensor is read by, straight into its target


class _InPlaceReader(safe_io.SafeFileSystemReader):
    """The checkpoint's reader, which reads a stored tensor that is one whole contiguous storage (what a table shard
    is) straight into the tensor it loads into. DCP's own reader ``torch.load``-s each stored tensor into new memory
    and then copies it: a second copy of the largest table at the peak (1.28 GB for a 5M x 64 table). Any other
    item (a slice of a stored tensor, a stream transform, bytes) is read as DCP reads it, one at a time, so that an
    item that cannot be read is named: a :class:`~lightning_rec.errors.CheckpointError` with its key, never a skip."""

    @override
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        rest: list[ReadItem] = []
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            stored = self.storage_data.get(req.storage_index)
            if stored is None:  # check_storage saw every chunk's entry: only a reader's plan of its own can miss
                raise _unreadable(self.pinned, req, KeyError("no storage entry"))
            if req.type == LoadItemType.TENSOR and not getattr(stored, "transform_descriptors", None):
                per_file.setdefault(stored.relative_path, []).append(req)
            else:
                rest.append(req)
        for relative_path, reqs in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for req in reqs:
                    target = planner.resolve_tensor(req).detach()
                    stored = self.storage_data[req.storage_index]
                    try:
                        whole = _read_whole(_Window(stream, stored.offset, stored.length), target, req)
                    except Exception as err:  # torch.load/zipfile raise many types for damaged bytes
                        raise _unreadable(self.pinned, req, err) from err
                    if whole:
                        planner.commit_tensor(req, target)
                    else:
                        rest.append(req)
        for req in rest:
            try:
                super().read_data(dataclasses.replace(plan, items=[req]), planner).wait()
            except Exception as err:
                raise _unreadable(self.pinned, req, err) from err
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _unreadable(pinned: layout.Pinned | None, req: ReadItem, err: BaseException) -> layout.CheckpointError:
    where = f"{str(pinned.path)!r}" if pinned is not None else "the checkpoint"
    reason = f"{type(err).__name__}: {err}".splitlines()[0].split(". ")[0]  # torch.load's advice is no use here
    return layout.CheckpointError(
        f"{where}: the tensor {req.storage_index.fqn!r} (chunk at {list(req.storage_index.offset or [])}) cannot be "
        f"read ({reason}); the checkpoint is damaged. Use an intact checkpoint."
    )


class _Window(io.RawIOBase):
    """``length`` bytes of ``base`` from ``offset``, as a seekable file of their own (what ``zipfile`` reads; DCP's
    own view has no ``read()`` of everything)."""

    def __init__(self, base: Any, offset: int, length: int) -> None:
        self.base, self.offset, self.length, self.position = base, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = min(max(start + position, 0), self.length)
        return self.position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self.length - self.position)
        if n <= 0:
            return 0
        self.base.seek(self.offset + self.position)
        got = self.base.readinto(view[:n])
        self.position += got
        return got


def _read_whole(stored: _Window, target: torch.Tensor, req: ReadItem) -> bool:
    """Read the tensor ``torch.save`` wrote at ``stored`` into ``target`` when it is all of one contiguous storage of
    ``target``'s shape and dtype, in this machine's byte order, uncompressed; ``False`` (nothing read) otherwise."""
    whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == tuple(target.shape)
    if not (whole and target.is_contiguous() and sys.byteorder == "little"):
        return False
    with skip_data():  # the tensor's metadata only: its storage is allocated, never written
        saved = torch.load(cast(IO[bytes], stored), weights_only=True)
    if not (
        isinstance(saved, torch.Tensor)
        and saved.shape == target.shape
        and saved.dtype == target.dtype
        and saved.is_contiguous()
        and saved.storage_offset() == 0
        and saved.untyped_storage().nbytes() == target.nbytes
    ):
        return False
    stored.seek(0)
    with zipfile.ZipFile(stored) as archive:
        names = archive.namelist()
        data = [i for i in archive.infolist() if i.filename.split("/")[-2:-1] == ["data"]]
        order = next((n for n in names if n.endswith("/byteorder")), None)
        if order is not None and archive.read(order) != b"little":
            return False
        if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED or data[0].file_size != target.nbytes:
            return False
        view = memoryview(target.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        with archive.open(data[0]) as source:
            filled = 0
            while filled < len(view):
                # in chunks: a zip member's readinto reads the whole request into a new bytes object first
                n = source.readinto(view[filled : filled + _CHUNK])  # type: ignore[attr-defined]
                if not n:
                    raise layout.CheckpointError(f"a stored tensor ends after {filled} of {len(view)} bytes")
                filled += n
    return True


M = TypeVar("M", bound=pl.LightningModule)
R = TypeVar("R")

_ATTEMPTS = 3  # reads of a checkpoint that a running job keeps replacing (``last.ckpt``)


def with_pinned(path: Path, read: Callable[[layout.Pinned], R]) -> R:
    """``read(pinned)`` of one published save of ``path`` (one process); tried again if a newer save replaced it
    before its files were open (:class:`~lightning_rec.errors.CheckpointReplacedError` after the last try)."""
    for attempt in range(_ATTEMPTS):
        try:
            with layout.pin(path, last_try=attempt + 1 == _ATTEMPTS) as pinned:
                return read(pinned)
        except CheckpointReplacedError:
            if attempt + 1 == _ATTEMPTS:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def load_module(
    cls: type[M],
    checkpoint: str | Path,
    *,
    map_location: str | torch.device | None = None,
    strict: bool | None = None,
    weights_only: bool | None = None,
    verify_hashes: bool = True,
    **kwargs: Any,
) -> M:
    """Build ``cls`` from a sharded checkpoint directory, unsharded, with every table whole (one process, no GPU,
    no process group): Lightning's ``load_from_checkpoint`` for checkpoint directories.

    As Lightning does: the module is built from the hyperparameters it saved (``save_hyperparameters()``), updated
    by ``kwargs``; ``configure_model`` and ``on_load_checkpoint`` run; then the weights load. Tables (or any tensor)
    the module built on ``meta`` are given storage first and filled from the checkpoint; one the checkpoint does
    not hold is an error, since it would keep uninitialised memory.

    Args:
        cls: the LightningModule class.
        checkpoint: a checkpoint directory written on any number of ranks with any plan.
        map_location: the device to put the module on (default: CPU).
        strict: whether missing/unexpected weights are errors (default: the module's ``strict_loading``, else True).
        weights_only: ``False`` lets ``meta.pt`` unpickle arbitrary objects (only for trusted checkpoints).
        verify_hashes: check the checkpoint files' SHA-256 first.
        kwargs: override saved hyperparameters.

    Example::

        model = MyModel.load_from_checkpoint("checkpoints/last.ckpt")      # a RecLightningModule subclass
        model = load_module(MyPlainLightningModule, "checkpoints/last.ckpt")
        model.eval(); logits = model(batch)

    Raises:
        CheckpointError: incomplete/corrupt checkpoint, or weights that do not match the module.
    """
    path = Path(checkpoint)

    def read(pinned: layout.Pinned) -> tuple[dict[str, torch.Tensor], dict[str, Any], M, list[str]]:
        problems = layout.verify_files(pinned, 0, 1, hashes=verify_hashes)  # before anything is unpickled
        if problems:
            raise layout.CheckpointError(f"Cannot read {str(path)!r}:\n  - " + "\n  - ".join(problems))
        meta = safe_io.load_meta(pinned, weights_only)
        module = _instantiate(cls, meta, kwargs)
        if is_overridden("configure_model", module):
            module.configure_model()
        on_meta = [k for k, t in module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor) and t.is_meta]
        # The weights are read into the module's own tensors (given storage first when built on meta): one copy of
        # each table, not the module's, the checkpoint's and DCP's read buffer (serving's export of a 5M x 64 table
        # peaked 2.5 GB higher).
        _allocate_meta_tensors(module)
        return _assemble(pinned, "", False, into=module.state_dict(keep_vars=True)), meta, module, on_meta

    state, meta, module, on_meta = with_pinned(path, read)
    strict = getattr(module, "strict_loading", True) if strict is None else strict
    module.on_load_checkpoint({**meta, "state_dict": state})
    live = module.state_dict(keep_vars=True)
    empty = [k for k in on_meta if k in live and k not in state]
    missing, unexpected = sorted(set(live) - set(state)), sorted(set(state) - set(live))
    problems = [f"{k}: built on meta and not in the checkpoint, so it would hold uninitialised memory" for k in empty]
    if strict:
        problems += [f"{k}: in {cls.__name__}, not in the checkpoint" for k in missing if k not in empty]
        problems += [f"{k}: in the checkpoint, not in {cls.__name__}" for k in unexpected]
    problems += [
        f"{k}: checkpoint shape {tuple(state[k].shape)}, {cls.__name__} shape {tuple(live[k].shape)}"
        for k in set(state) & set(live)
        if isinstance(live[k], torch.Tensor) and tuple(live[k].shape) != tuple(state[k].shape)
    ]
    if problems:
        raise layout.CheckpointError(
            f"Checkpoint {str(path)!r} does not match {cls.__name__}:\n  - " + "\n  - ".join(sorted(problems))
        )
    _allocate_meta_tensors(module)
    read_in_place = {k for k, v in state.items() if k in live and _same_memory(v, live[k])}
    module.load_state_dict({k: v for k, v in state.items() if k in live and k not in read_in_place}, strict=False)
    if meta.get("model_extra"):
        module.load_state_dict(meta["model_extra"], strict=False)
    return module.to(map_location) if map_location is not None else module


def _same_memory(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same tensor data (one read into the other's memory)."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and not b.is_meta
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.stride() == b.stride()
    )


def _instantiate(cls: type[M], meta: dict[str, Any], kwargs: dict[str, Any]) -> M:
    """``cls`` built from the saved hyperparameters, updated by ``kwargs`` (as Lightning's loading does)."""
    hparams = dict(meta.get(cls.CHECKPOINT_HYPER_PARAMS_KEY) or {})
    params = inspect.signature(cls.__init__).parameters
    name = meta.get(cls.CHECKPOINT_HYPER_PARAMS_NAME)
    if name and name in params:
        hparams = {name: hparams}
    merged = {**hparams, **kwargs}
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        merged = {k: v for k, v in merged.items() if k in params}
    try:
        inspect.signature(cls).bind(**merged)
    except TypeError as err:
        raise layout.CheckpointError(
            f"cannot build {cls.__name__} from the checkpoint: {err} (it holds the hyperparameters "
            f"{sorted(hparams)}). HINT: call `self.save_hyperparameters()` in {cls.__name__}.__init__, or pass the "
            "missing arguments (`load_from_checkpoint(path, name=value)`; `export_inference(..., init_args={...})`)."
        ) from None
    return cls(**merged)


@torch.no_grad()
def _allocate_meta_tensors(module: torch.nn.Module) -> None:
    """Give every module that holds ``meta`` tensors CPU storage (the checkpoint fills it next)."""
    for sub in module.modules():
        if any(t.is_meta for t in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]):
            sub.to_empty(device="cpu", recurse=False)


def load_exported(path: str | Path, device: str | None = "cpu") -> dict[str, torch.Tensor]:
    """Read a file written by :func:`export` (safetensors or weights-only torch) as a state dict."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device=device or "cpu")
    return torch.load(path, map_location=device, weights_only=True)
