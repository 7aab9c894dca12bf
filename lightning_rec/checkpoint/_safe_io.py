"""Reading a checkpoint without unpickling arbitrary objects.

A checkpoint directory has two pickled files: DCP's ``.metadata`` (its index of tensor chunks, which
``torch.distributed.checkpoint`` reads with a bare ``pickle.load``) and ``meta.pt`` (Lightning's loop,
callback and scheduler state). Both are read here with allow-lists, so a checkpoint from an untrusted
source can at worst fail to load, never run code.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from typing_extensions import override

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


def read_metadata(path: Path | Pinned) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint directory ``path`` (or of a pinned checkpoint), unpickled with an
    allow-list.

    Raises:
        UnsafeCheckpointError: the file refers to anything but DCP's metadata classes, tensor sizes and dtypes.
    """
    file = path.file(METADATA_FILE) if isinstance(path, Pinned) else Path(path) / METADATA_FILE
    with open(file, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}/.metadata holds a {type(metadata).__name__}, not DCP Metadata.")
    return metadata


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
    file = path.file(META_FILE) if isinstance(path, Pinned) else path
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
