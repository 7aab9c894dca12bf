"""Reading a checkpoint without unpickling arbitrary objects.

A checkpoint directory has two pickled files: DCP's ``.metadata`` (its index of tensor chunks, which
``torch.distributed.checkpoint`` reads with a bare ``pickle.load``) and ``meta.pt`` (Lightning's loop,
callback and scheduler state). Both are read here with allow-lists, so a checkpoint from an untrusted
source can at worst fail to load, never run code.

Nor can it make a load read anything but its own files, or read them without end: ``.metadata``'s storage entries
(which file, at which offset, how many bytes) must name files the manifest lists and lie within their recorded sizes,
and every tensor it lists must be stored whole (each chunk with its storage entry, the chunks covering the tensor):
a checkpoint whose index was tampered with is refused naming the tensor, rather than loading part of it or reading
uninitialised memory (see :func:`check_storage`). The files themselves are opened by
:mod:`~lightning_rec.checkpoint._confined`.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from typing_extensions import override

from lightning_rec.checkpoint import _confined
from lightning_rec.checkpoint._layout import META_FILE, METADATA_FILE, Pinned
from lightning_rec.errors import CheckpointError, UnsafeCheckpointError

# Classes DCP's metadata pickle refers to (module -> names). Anything else is refused.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
        "StorageMeta",
        "MetadataIndex",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint._extension": {"StreamTransformExtension"},
    "torch": {"Size"},
    "torch._utils": {"_get_layout"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"the checkpoint's .metadata refers to {module}.{name}, which is not part of DCP's metadata format; "
            "refusing to unpickle it."
        )


_MAX_METADATA_BYTES = 1 << 30  # an unpinned .metadata (a save's own staging folder) has no recorded size


def read_metadata(path: Path | Pinned) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint directory ``path`` (or of a pinned checkpoint: the file its manifest
    lists, checked against its recorded size and SHA-256 first), unpickled with an allow-list, its storage entries
    checked by :func:`check_storage`.

    Raises:
        UnsafeCheckpointError: the file refers to anything but DCP's metadata classes, tensor sizes and dtypes.
        CheckpointError: the file is not the one the manifest recorded, or its index names a file the manifest does
            not list, bytes beyond a file's recorded size, or a tensor not stored whole (naming it).
    """
    if isinstance(path, Pinned):
        folder, raw = path.path, verified_bytes(path, METADATA_FILE)
    else:
        folder = Path(path)
        try:
            raw = _confined.read_entry(folder, METADATA_FILE, limit=_MAX_METADATA_BYTES)
        except FileNotFoundError:
            raise CheckpointError(f"{str(folder)!r} has no {METADATA_FILE}: not a checkpoint directory.") from None
    metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{folder}/.metadata holds a {type(metadata).__name__}, not DCP Metadata.")
    sizes = {n: r["size"] for n, r in path.manifest["files"].items()} if isinstance(path, Pinned) else None
    check_storage(metadata, folder, sizes)
    return metadata


def verified_bytes(pinned: Pinned, name: str) -> bytes:
    """The pinned file ``name`` (one the manifest lists), read to its recorded size and checked against its
    recorded SHA-256: what an unpickler may then read.

    Raises:
        CheckpointError: the manifest does not list ``name``, or the file is not the one recorded.
    """
    record, fd = pinned.manifest["files"].get(name), pinned.fds.get(name)
    if record is None or fd is None:
        what = "does not list it" if record is None else "lists it, but it is missing"
        raise CheckpointError(f"{str(pinned.path)!r}: cannot read {name}: the checkpoint's manifest {what}.")
    if os.fstat(fd).st_size != record["size"]:
        raise CheckpointError(
            f"{str(pinned.path)!r}: {name}: {os.fstat(fd).st_size} bytes, expected {record['size']} (truncated or "
            "overwritten)"
        )
    raw = _confined.read_small(fd, name, pinned.path, limit=record["size"])
    if hashlib.sha256(raw).hexdigest() != record["sha256"]:
        raise CheckpointError(
            f"{str(pinned.path)!r}: {name}: SHA-256 differs from the one recorded at save time (corrupt)"
        )
    return raw


def check_storage(metadata: Metadata, folder: Path, sizes: dict[str, int] | None = None) -> None:
    """Raise unless every tensor ``metadata`` lists is stored whole, in files of ``folder`` (``sizes``: the files the
    manifest lists, with their recorded sizes; ``None``: any plain file name in ``folder``).

    Whole: every chunk lies within its tensor and has a storage entry, the distinct chunks together hold as many
    elements as the tensor (this package's saves write each element once), and each storage entry lies within the
    recorded size of a listed file. ``bytes`` entries (pickled objects) are refused: this format never writes one.

    Raises:
        CheckpointError: naming the tensor (its DCP key) and what is wrong with its entry.
    """
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"{folder}/.metadata has no storage index; the checkpoint is incomplete or altered.")

    def refuse(key: str, why: str) -> CheckpointError:
        return CheckpointError(
            f"{str(folder)!r}: the tensor {key!r} {why}; refusing to load the checkpoint (it was altered or is "
            "incomplete). Use an intact checkpoint."
        )

    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata) or not isinstance(md, TensorStorageMetadata):
            raise refuse(key, "is recorded as a pickled object, not a tensor (this checkpoint format stores none)")
        size = tuple(md.size)
        covered, seen = 0, set()
        for chunk in md.chunks:
            offsets, lengths = tuple(chunk.offsets), tuple(chunk.sizes)
            if len(offsets) != len(size) or len(lengths) != len(size):
                raise refuse(key, f"has a chunk of {len(lengths)} dimensions in a tensor of {len(size)}")
            if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, size)):
                raise refuse(key, f"has a chunk at {list(offsets)} of {list(lengths)} outside its shape {list(size)}")
            if MetadataIndex(key, chunk.offsets) not in storage:
                raise refuse(key, f"has no stored data for its chunk at {list(offsets)}")
            if (offsets, lengths) not in seen:
                seen.add((offsets, lengths))
                covered += math.prod(lengths)
        if covered != math.prod(size):
            raise refuse(key, f"is stored as {covered} of its {math.prod(size)} elements")
    for index, info in storage.items():
        tensor = str(getattr(index, "fqn", index))
        name: Any = getattr(info, "relative_path", None)
        _confined.check_name(name, folder, what=f"file of the tensor {tensor!r}")
        offset: Any = getattr(info, "offset", None)
        length: Any = getattr(info, "length", None)
        if not all(isinstance(v, int) and v >= 0 for v in (offset, length)):
            raise refuse(tensor, f"is stored at offset {offset!r}, length {length!r} of {name!r}")
        if sizes is not None:
            if name not in sizes:
                raise refuse(tensor, f"is stored in {name!r}, a file the checkpoint's manifest does not list")
            if offset + length > sizes[name]:
                raise refuse(
                    tensor, f"is stored at bytes {offset}-{offset + length} of {name!r}, which has {sizes[name]} bytes"
                )


class _PinnedFiles(FileSystem):
    """DCP's local file system, opening a pinned checkpoint's files (and only those)."""

    def __init__(self, pinned: Pinned) -> None:
        self.pinned = pinned

    @override
    def concat_path(self, path: str | os.PathLike, suffix: str) -> str | os.PathLike:
        if suffix not in self.pinned.fds:
            raise CheckpointError(
                f"{self.pinned.path}/.metadata refers to {suffix!r}, which its manifest does not list."
            )
        return self.pinned.file(suffix)


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with :func:`read_metadata`'s allow-list instead of ``pickle.load``; given a
    :class:`~lightning_rec.checkpoint._layout.Pinned` checkpoint, it reads that save's open files.

    Example::

        dcp.load(state_dict, storage_reader=SafeFileSystemReader("epoch=0-step=10.ckpt"))
        with pin(Path("last.ckpt")) as ckpt:
            dcp.load(state_dict, storage_reader=SafeFileSystemReader(ckpt))
    """

    def __init__(self, path: str | os.PathLike | Pinned) -> None:
        self.pinned = path if isinstance(path, Pinned) else None
        super().__init__(path.path if isinstance(path, Pinned) else path)
        if self.pinned is not None:
            self.fs = _PinnedFiles(self.pinned)

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files are not a format this package writes
            raise UnsafeCheckpointError("per-rank DCP metadata files are not supported")
        metadata = read_metadata(self.pinned or Path(self.path))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


def load_meta(path: Path | Pinned, weights_only: bool | None = None) -> dict[str, Any]:
    """Lightning's tensor-free checkpoint part (``meta.pt``), loaded with ``torch.load(weights_only=True)``.

    Lightning's ``AttributeDict`` and the plain configuration dataclasses registered with
    :func:`lightning_rec.config.checkpoint_safe` (this package's ``SparseFeature``, ``EmbeddingOptimizer``, ...:
    what ``save_hyperparameters()`` records for the shipped models; users register their own the same way) are
    allowed. Anything else is refused unless the caller passes ``weights_only=False`` (Lightning's
    ``trainer.fit(..., weights_only=False)``): only do that for checkpoints you trust.

    ``path``: the ``meta.pt`` file, or a pinned checkpoint (its ``meta.pt``).
    """
    file: Any = io.BytesIO(verified_bytes(path, META_FILE)) if isinstance(path, Pinned) else path
    if isinstance(path, Pinned):
        path = path.path / META_FILE  # named in messages
    if weights_only is False:
        return torch.load(file, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals(_plain_classes()):
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = next(
            (line.strip() for line in str(err).splitlines() if "Unsupported global" in line), str(err).splitlines()[0]
        )
        raise UnsafeCheckpointError(
            f"{path} holds objects that are not plain data, so it was not unpickled ({reason}).\n"
            "HINT: keep hyperparameters plain (numbers, strings, lists, dicts), register a plain dataclass of yours "
            "with `@lightning_rec.checkpoint_safe`, or, for a checkpoint you trust, pass `weights_only=False` to "
            "`trainer.fit/validate/test/predict`."
        ) from None


def _plain_classes() -> list:
    """Classes ``meta.pt`` may contain: Lightning's ``AttributeDict`` and every class registered with
    :func:`lightning_rec.config.checkpoint_safe` (data holders whose unpickling runs no code of theirs)."""
    from lightning.fabric.utilities.data import AttributeDict

    import lightning_rec.data  # noqa: F401  (registers its configuration classes, e.g. SyntheticTable)
    from lightning_rec.config import checkpoint_safe_classes

    return [AttributeDict, *checkpoint_safe_classes()]


def dumps_meta(meta: dict[str, Any]) -> bytes:
    """Serialise ``meta`` (for ``meta.pt``) and return the bytes."""
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    return buffer.getvalue()
