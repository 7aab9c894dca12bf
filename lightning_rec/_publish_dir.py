"""The publish directory on disk (what :class:`lightning_rec.publish.ModelPublisher` writes and servers follow):
names, the atomic pointer, what is complete, retention, and the background full export.

Layout (``docs/fresh-models.md``, "The publisher")::

    DIR/
      LATEST                   {"version": 7}: temp file + os.replace, written last
      versions/v000007/        renamed into place from versions/.v000007.<random> once complete
         manifest.json         written last inside the directory
         delta.r0.pt ...       one part per writing rank
      full/v000005.pt2         the full export at version 5 (renamed into place when done)
      full/v000005.json        its manifest, written after the .pt2 is in place
      checkpoints/v000005/     the sharded checkpoint the full is exported from (removed once exported)

Only rank 0 calls the functions that change the directory (a staging directory, a rename, the pointer, removals);
every rank writes its own delta part into the staging directory rank 0 made.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lightning_rec.checkpoint._layout import fsync_dir
from lightning_rec.serving.deltas import FORMAT, LATEST_FILE, MANIFEST_FILE, read_latest

# The format's names are the reader's (serving.deltas): one definition for both sides.
POINTER, MANIFEST = LATEST_FILE, MANIFEST_FILE
VERSIONS, FULL, CHECKPOINTS = "versions", "full", "checkpoints"
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
_STAGING = re.compile(r"^\.v(\d{6,})\.")

__all__ = [
    "FORMAT",
    "BackgroundExport",
    "complete_versions",
    "delta_part",
    "ids_of_deltas",
    "is_complete_checkpoint",
    "fulls",
    "read_latest",
    "manifest",
    "newest_chain",
    "remove_checkpoint",
    "remove_incomplete",
    "retain",
    "version_manifest",
    "version_name",
    "write_json_atomic",
    "write_pointer",
]


def version_name(version: int) -> str:
    """``v000007``: the directory/file stem of a version (sorts as the number does up to a million versions)."""
    return f"v{version:06d}"


def delta_part(rank: int) -> str:
    """The file name of one rank's part of a delta."""
    return f"delta.r{rank}.pt"


def write_json_atomic(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` as JSON through a temporary file and ``os.replace``: a reader sees the old file
    or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_pointer(root: Path, version: int) -> None:
    """Point ``LATEST`` at ``version`` (atomically)."""
    write_json_atomic(root / POINTER, {"version": version})


def manifest(
    version: int,
    kind: str,
    step: int,
    epoch: int,
    world_size: int,
    table_dtype: str,
    event_time: float | None,
    files: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The manifest of a delta (``kind="delta"``) or a full export (``kind="full"``) of ``version``."""
    return {
        "format": FORMAT,
        "version": version,
        "kind": kind,
        "previous": version - 1 if kind == "delta" and version > 1 else None,
        "step": step,
        "event_time": event_time,
        "epoch": epoch,
        "world_size": world_size,
        "table_dtype": table_dtype,
        "created": datetime.now(timezone.utc).isoformat(),
        "files": dict(sorted(files.items())),
    }


def complete_versions(root: Path) -> list[int]:
    """The versions whose directory is in place (renamed from staging, so with its manifest), ascending."""
    found = []
    for entry in (root / VERSIONS).iterdir() if (root / VERSIONS).is_dir() else ():
        match = _VERSION_DIR.match(entry.name)
        if match and (entry / MANIFEST).is_file():
            found.append(int(match.group(1)))
    return sorted(found)


def fulls(root: Path) -> list[int]:
    """The versions with a full export in place (its ``.pt2`` and, written after it, its manifest), ascending."""
    found = []
    for entry in (root / FULL).glob("v*.json") if (root / FULL).is_dir() else ():
        match = _VERSION_DIR.match(entry.stem)
        if match and entry.with_suffix(".pt2").is_file():
            found.append(int(match.group(1)))
    return sorted(found)


def newest_chain(root: Path, at_most: int | None = None) -> int | None:
    """The newest version ``v`` (``<= at_most``) a server can reach: a full ``f <= v`` and every delta ``f+1..v`` in
    place; ``None`` if there is none."""
    versions = set(complete_versions(root))
    best = None
    for f in fulls(root):
        v = f
        while v + 1 in versions and (at_most is None or v + 1 <= at_most):
            v += 1
        if (at_most is None or f <= at_most) and (best is None or v > best):
            best = v
    return best


def remove_incomplete(root: Path) -> list[str]:
    """Remove what a killed publish left: staging directories of versions and temporary files of fulls and of the
    pointer (never visible to a server). Returns their names."""
    removed = []
    for entry in (root / VERSIONS).iterdir() if (root / VERSIONS).is_dir() else ():
        if _STAGING.match(entry.name) or (_VERSION_DIR.match(entry.name) and not (entry / MANIFEST).is_file()):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(f"{VERSIONS}/{entry.name}")
    for folder in (root / FULL, root):
        for entry in folder.glob(".*") if folder.is_dir() else ():
            if entry.is_file():
                entry.unlink(missing_ok=True)
                removed.append(str(entry.relative_to(root)))
    return removed


def retain(root: Path, keep: int) -> list[str]:
    """Delete versions and fulls beyond the newest ``keep`` versions, never the newest full ``<= LATEST`` nor any
    delta after it (the chain a server starting now needs), nor anything newer than ``LATEST`` (being published).
    Returns what was removed."""
    pointer = read_latest(root)
    if pointer is None:
        return []
    base = max((f for f in fulls(root) if f <= pointer), default=None)
    versions = complete_versions(root)
    kept = set(versions[-keep:]) | {v for v in versions if v > pointer}
    if base is not None:
        kept |= set(range(base, pointer + 1))
    removed = []
    for v in versions:
        if v not in kept:
            shutil.rmtree(root / VERSIONS / version_name(v), ignore_errors=True)
            removed.append(f"{VERSIONS}/{version_name(v)}")
    for f in fulls(root):
        if f not in kept:
            for suffix in (".json", ".pt2"):  # the manifest first: without it the .pt2 is not a full
                (root / FULL / version_name(f)).with_suffix(suffix).unlink(missing_ok=True)
            removed.append(f"{FULL}/{version_name(f)}.pt2")
    return removed


def version_manifest(root: Path, version: int) -> dict[str, Any] | None:
    """The manifest of a complete version, or ``None``."""
    try:
        return dict(json.loads((root / VERSIONS / version_name(version) / MANIFEST).read_text()))
    except FileNotFoundError:
        return None


def is_complete_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a complete sharded checkpoint (the export's input)."""
    from lightning_rec.checkpoint._io import is_checkpoint

    return is_checkpoint(path)


def remove_checkpoint(path: Path) -> None:
    """Remove a checkpoint the publisher wrote (complete or not)."""
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        path.parent.rmdir()  # the folder, once empty


def ids_of_deltas(root: Path, versions: Iterable[int]) -> dict[str, Any]:
    """The table rows the deltas of ``versions`` carry (every rank's part), by table name: what a server that took
    them holds beyond an older state."""
    import torch

    ids: dict[str, list[Any]] = {}
    for v in versions:
        for part in sorted((root / VERSIONS / version_name(v)).glob("delta.r*.pt")):
            for key, value in torch.load(part, map_location="cpu", weights_only=True).items():
                if key.startswith("table/") and key.endswith("/ids"):
                    ids.setdefault(key[len("table/") : -len("/ids")], []).append(value)
    return {table: torch.cat(parts).unique() for table, parts in ids.items()}


class BackgroundExport:
    """``export_inference(checkpoint, full/vN.pt2, format="pt2")`` in a process of its own, then the full's manifest;
    training goes on meanwhile.

    The child writes ``full/.vN.<random>.pt2`` and renames it into place, then writes ``full/vN.json`` through a
    temporary file: a full exists for a server only once its manifest does. Its output goes to ``full/vN.log``.
    Created waiting; :meth:`start` starts it (the publisher runs one at a time: two compiles of the same graph would
    share AOTInductor's cache entries, and a training machine has few cores to spare).
    """

    def __init__(self, root: Path, version: int, checkpoint: Path, info: dict[str, Any], export_args: dict[str, Any]):
        self.root, self.version, self.checkpoint = root, version, checkpoint
        self.log = root / FULL / f"{version_name(version)}.log"
        self.job = {"root": str(root), "version": version, "checkpoint": str(checkpoint), "info": info, **export_args}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the child (once)."""
        if self.process is not None:
            return
        (self.root / FULL).mkdir(parents=True, exist_ok=True)
        code = (
            "import json,sys; from lightning_rec._publish_dir import export_full; export_full(json.loads(sys.argv[1]))"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(self.job)], stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def running(self) -> bool:
        """Started and not ended."""
        return self.process is not None and self.process.poll() is None

    def done(self) -> bool:
        """Whether the child has ended (without waiting)."""
        return self.process is not None and self.process.poll() is not None

    def stop(self) -> None:
        """End the child now (its partial output is a temporary file that :func:`remove_incomplete` removes)."""
        if self.running():
            assert self.process is not None
            self.process.kill()
            self.process.wait()

    def failure(self) -> str | None:
        """Wait for the child; ``None`` if the export succeeded, else what failed (one line, naming its log)."""
        self.start()
        assert self.process is not None
        if self.process.wait() == 0:
            return None
        tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] if self.log.exists() else []
        return (
            f"ModelPublisher: the full export of version {self.version} from {self.checkpoint} failed (exit "
            f"{self.process.returncode}): {tail[0] if tail else 'no output'}. See {self.log}."
        )


def export_full(job: dict[str, Any]) -> None:
    """The child's work (see :class:`BackgroundExport`): the ``.pt2``, renamed into place, then its manifest."""
    from lightning_rec.serving.deltas import file_record
    from lightning_rec.serving.export import export_inference

    root, version = Path(job["root"]), int(job["version"])
    target = root / FULL / f"{version_name(version)}.pt2"
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}.", suffix=".pt2")
    os.close(fd)
    try:
        export_inference(job["checkpoint"], tmp, format="pt2", table_dtype=job["info"]["table_dtype"], **job["export"])
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    info = job["info"]
    document = manifest(
        version,
        "full",
        info["step"],
        info["epoch"],
        info["world_size"],
        info["table_dtype"],
        info["event_time"],
        {target.name: file_record(target)},
    )
    write_json_atomic(target.with_suffix(".json"), document)
