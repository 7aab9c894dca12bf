"""The checkpoint directory on disk: write somewhere invisible, mark complete, then make it visible.

Layout of ``epoch=3-step=400.ckpt/``::

    .metadata        DCP's index of every tensor chunk (rank 0)
    __<r>_0.distcp   rank r's own shards: its table shards, fused optimizer state, and the replicated tensors
                     DCP assigned it (each replicated tensor is written once)
    meta.pt          Lightning's tensor-free state (loops, callbacks, schedulers, param groups), the plan (rank 0)
    COMPLETE         written last: JSON with the size and SHA-256 of every file above

Every save goes to a hidden sibling ``.epoch=3-step=400.ckpt.partial`` and is renamed into place only after
``COMPLETE`` is written, so a visible checkpoint is always complete; a crash mid-save leaves only the hidden
directory, which the next save to that name clears. Overwriting (``last.ckpt``) moves the old one aside,
renames the new one in, then deletes the old one; deleting renames first, so no half-deleted directory ever
looks like a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from lightning_rec.errors import CheckpointError

META_FILE = "meta.pt"
COMPLETE_FILE = "COMPLETE"
METADATA_FILE = ".metadata"
FORMAT = "lightning_rec.checkpoint/1"
MODEL_PREFIX = "model/"  # DCP keys of the model state_dict
OPTIM_PREFIX = "optim/"  # DCP keys of optimizer state: optim/<i>/<fqn>/<state name>
_CHUNK = 1 << 22


def staging_path(path: Path) -> Path:
    """Where a save to ``path`` is written before it is complete."""
    return path.parent / f".{path.name}.partial"


def _aside_path(path: Path, what: str) -> Path:
    return path.parent / f".{path.name}.{what}"


def file_digest(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of one file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def own_files(directory: Path, rank: int) -> list[Path]:
    """The DCP data files rank ``rank`` wrote (``__<rank>_*.distcp``)."""
    return sorted(directory.glob(f"__{rank}_*.distcp"))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and flush it to disk."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def mark_complete(directory: Path, files: dict[str, dict[str, Any]], info: dict[str, Any]) -> None:
    """Write ``COMPLETE`` (the manifest of ``files`` and ``info``) into ``directory``, last."""
    manifest = {"format": FORMAT, **info, "files": dict(sorted(files.items()))}
    write_file(directory / COMPLETE_FILE, json.dumps(manifest, indent=1).encode())
    _fsync_dir(directory)


def read_manifest(path: Path) -> dict[str, Any]:
    """The ``COMPLETE`` manifest of the checkpoint at ``path``.

    Raises:
        CheckpointError: ``path`` is not a complete checkpoint directory (says what is missing).
    """
    if not path.exists():
        raise CheckpointError(f"Checkpoint {str(path)!r} does not exist.")
    if not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is a file; checkpoints of the recshard strategy are directories (torch.distributed."
            "checkpoint). HINT: a single-file state dict comes from `lightning-rec export`; to load it, build the "
            "plain model and call `load_state_dict`."
        )
    complete = path / COMPLETE_FILE
    if not complete.is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a complete checkpoint: it has no {COMPLETE_FILE} marker (written last by every "
            "save), so the save that made it did not finish. Use an earlier checkpoint."
        )
    try:
        manifest = json.loads(complete.read_text())
    except ValueError as err:
        raise CheckpointError(f"{complete} is corrupt ({err}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{complete} is not a {FORMAT} manifest.")
    return manifest


def verify_files(path: Path, manifest: dict[str, Any], rank: int, world_size: int, hashes: bool = True) -> list[str]:
    """Problems with the files of the checkpoint at ``path``: missing, truncated, or (if ``hashes``) changed.

    Sizes are checked for every file; each rank hashes every ``world_size``-th file, so together the ranks read
    each file once.
    """
    problems = []
    for i, (name, expected) in enumerate(sorted(manifest["files"].items())):
        file = path / name
        if not file.is_file():
            problems.append(f"{name}: missing")
            continue
        size = file.stat().st_size
        if size != expected["size"]:
            problems.append(f"{name}: {size} bytes, expected {expected['size']} (truncated or overwritten)")
        elif hashes and i % world_size == rank and file_digest(file)["sha256"] != expected["sha256"]:
            problems.append(f"{name}: SHA-256 differs from the one recorded at save time (corrupt)")
    return problems


def publish(staging: Path, path: Path) -> None:
    """Make the complete checkpoint in ``staging`` visible as ``path`` (rank 0), replacing any old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.is_file():
        path.unlink()
    if path.is_dir():
        old = _aside_path(path, "replaced")
        remove_tree(old)
        os.rename(path, old)
        os.rename(staging, path)
        remove_tree(old)
    else:
        os.rename(staging, path)
    _fsync_dir(path.parent)


def recover(path: Path) -> Path:
    """``path``, or the complete checkpoint a crash between the two renames of :func:`publish` left aside."""
    old = _aside_path(path, "replaced")
    if not path.exists() and (old / COMPLETE_FILE).is_file():
        return old
    return path


def remove_tree(path: Path) -> None:
    """Delete a checkpoint (directory, file or link): renamed aside first, then removed."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        doomed = _aside_path(path, "deleting")
        if doomed.exists():
            shutil.rmtree(doomed)
        os.rename(path, doomed)
        shutil.rmtree(doomed)
