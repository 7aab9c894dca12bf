"""An index folder on disk: the FAISS index of a catalogue's embeddings, the item id of each row and the manifest
(:mod:`lightning_rec.retrieval.index` fills it; :class:`~lightning_rec.retrieval.Retriever` reads it)::

    OUT/index.faiss     the FAISS index (row i = the i-th catalogue item), inner product
    OUT/item_ids.npy    int64, row -> item id
    OUT/manifest.json   {"format": "lightning_rec.retrieval.index", "version": 1, "checkpoint": {"path", "global_step", "epoch",
                        "id", "run"}, "global_step", "run" (the checkpoint's, again), "model", "part", "devices",
                        "num_items", "dim", "metric", "kind", "params", "faiss", "created",
                        "files": {name: {"sha256", "size"}}}

A folder is written into a staging folder beside ``OUT`` and renamed to ``OUT`` once whole; an existing index is
moved aside first (and put back if the rename fails), then removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import shutil
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "INDEX_FILE",
    "INDEX_FORMAT",
    "INDEX_VERSION",
    "ITEM_IDS_FILE",
    "MANIFEST_FILE",
    "LoadedIndex",
    "check_output",
    "faiss_module",
    "load_index",
    "write_index_folder",
]

INDEX_FILE, ITEM_IDS_FILE, MANIFEST_FILE = "index.faiss", "item_ids.npy", "manifest.json"
INDEX_FORMAT, INDEX_VERSION = "lightning_rec.retrieval.index", 1  # the module that writes it
_FAISS_HINT = "pip install 'lightning-rec[retrieval]' (it installs faiss-cpu)"


def faiss_module() -> types.ModuleType:
    """``faiss``, or an ``ImportError`` naming the extra that installs it."""
    try:
        return importlib.import_module("faiss")
    except ImportError as err:
        raise ImportError(
            f"lightning_rec.retrieval needs faiss, which is not installed ({err}). HINT: {_FAISS_HINT}."
        ) from None


def check_output(output: str | Path, overwrite: bool) -> Path:
    """``output`` as a path, refused when it exists and ``overwrite`` is false, or when it is not a folder this
    package wrote (an existing folder is replaced only if it holds an index's manifest).

    Raises:
        FileExistsError: one line naming the folder and what to do.
    """
    output = Path(output)
    if output.exists() or output.is_symlink():
        if not overwrite:
            raise FileExistsError(
                f"{str(output)!r} exists; an index is never written over it. HINT: choose another folder, or pass "
                "--overwrite (overwrite=True) to replace it once the new index is whole."
            )
        if not (output.is_dir() and (output / MANIFEST_FILE).is_file()):
            raise FileExistsError(
                f"{str(output)!r} exists and is not an index folder (no {MANIFEST_FILE}); --overwrite replaces only "
                "an index. HINT: choose another folder."
            )
    return output


# -- the index folder -----------------------------------------------------------------------------------------------


def _faiss_index(kind: str, params: Mapping[str, int], vectors: np.ndarray) -> Any:
    faiss = faiss_module()
    dim = vectors.shape[1]
    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, params["hnsw_m"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = params["hnsw_ef_construction"]
        index.hnsw.efSearch = params["hnsw_ef_search"]
    else:
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFFlat(quantizer, dim, params["ivf_nlist"], faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = 0  # k-means's seed: the same lists from the same checkpoint
        index.train(vectors)
        index.nprobe = params["nprobe"]
    index.add(vectors)
    return index


def _digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"sha256": h.hexdigest(), "size": path.stat().st_size}


def write_index_folder(
    output: Path,
    item_ids: np.ndarray,
    vectors: np.ndarray,
    kind: str,
    params: Mapping[str, int],
    info: Mapping[str, Any],
    overwrite: bool,
) -> dict[str, Any]:
    """Build the index and write the folder (staged beside ``output``, then renamed into place); the manifest."""
    faiss = faiss_module()
    index = _faiss_index(kind, params, vectors)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        faiss.write_index(index, str(staging / INDEX_FILE))
        np.save(staging / ITEM_IDS_FILE, item_ids.astype(np.int64))
        manifest = {
            "format": INDEX_FORMAT,
            "version": INDEX_VERSION,
            **info,
            "num_items": int(item_ids.shape[0]),
            "dim": int(vectors.shape[1]),
            "metric": "inner_product",
            "kind": kind,
            "params": dict(params),
            "faiss": faiss.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "files": {name: _digest(staging / name) for name in (INDEX_FILE, ITEM_IDS_FILE)},
        }
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
        for name in (INDEX_FILE, ITEM_IDS_FILE, MANIFEST_FILE):
            with (staging / name).open("rb") as f:
                os.fsync(f.fileno())
        _publish(staging, check_output(output, overwrite))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _publish(staging: Path, output: Path) -> None:
    """``staging`` renamed to ``output``; an index already there moved aside first and removed after."""
    aside = output.with_name(f".{output.name}.old-{os.getpid()}")
    if output.exists():
        output.rename(aside)
    try:
        staging.rename(output)
    except BaseException:
        if aside.exists() and not output.exists():
            aside.rename(output)  # put the old index back: nothing changed
        raise
    with contextlib.suppress(OSError):
        fd = os.open(output.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    shutil.rmtree(aside, ignore_errors=True)


# -- reading an index back ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedIndex:
    """An index folder read back: the FAISS index, the item id of each row, the manifest."""

    index: Any
    item_ids: np.ndarray
    manifest: dict[str, Any]


def load_index(folder: str | Path, *, verify: bool = True) -> LoadedIndex:
    """Read an index folder written by :func:`build_index`, each file checked against the manifest's SHA-256
    (``verify=False`` skips that), the search parameters (``efSearch``, ``nprobe``) set from the manifest.

    Raises:
        ValueError: the folder is not an index, is of a newer format, or a file differs from the manifest (named).
        ImportError: faiss is not installed.

    Example::

        loaded = load_index("index")
        scores, rows = loaded.index.search(queries, 10)
        items = loaded.item_ids[rows]
    """
    faiss = faiss_module()
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{str(folder)!r} is not an index folder: {MANIFEST_FILE} cannot be read ({err}).") from None
    if manifest.get("format") != INDEX_FORMAT or int(manifest.get("version", 0)) > INDEX_VERSION:
        raise ValueError(
            f"{str(folder / MANIFEST_FILE)!r}: format {manifest.get('format')!r} version {manifest.get('version')}; "
            f"this lightning_rec reads {INDEX_FORMAT!r} up to version {INDEX_VERSION}. HINT: upgrade lightning_rec or "
            "build the index again (`lightning-rec index`)."
        )
    if verify:
        for name, expected in manifest["files"].items():
            got = _digest(folder / name) if (folder / name).is_file() else None
            if got != expected:
                raise ValueError(
                    f"{str(folder / name)!r} is not the file the index was written with (SHA-256/size differ from "
                    f"{MANIFEST_FILE}, or it is missing). HINT: build the index again."
                )
    index = faiss.read_index(str(folder / INDEX_FILE))
    params = manifest.get("params", {})
    if manifest["kind"] == "hnsw":
        index.hnsw.efSearch = int(params["hnsw_ef_search"])
    elif manifest["kind"] == "ivf":
        index.nprobe = int(params["nprobe"])
    item_ids = np.load(folder / ITEM_IDS_FILE, allow_pickle=False)
    if item_ids.shape != (index.ntotal,):
        raise ValueError(f"{str(folder)!r}: {item_ids.shape[0]} item ids for {index.ntotal} index rows.")
    return LoadedIndex(index, item_ids, manifest)
