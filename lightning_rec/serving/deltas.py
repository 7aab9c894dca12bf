"""What a publish directory holds and how it is read: the versions a trainer publishes (a full ``.pt2`` package now
and then, a **delta** for every version), their manifests, and the exact bytes a delta ships for a table's rows.

A publish directory (written by :class:`~lightning_rec.publish.ModelPublisher`, followed by
:class:`~lightning_rec.serving.FreshModel` and the C++ example)::

    DIR/
      LATEST                      {"version": 7}: the newest complete version (written last, atomically)
      versions/v000007/           one version, renamed into place when complete
         manifest.json            the version's Manifest (written last inside the folder)
         delta.r0.pt              one part per writing rank (disjoint rows): torch.save of a flat dict
         delta.r1.pt
      full/v000005.pt2            a full export at version 5
      full/v000005.json           its Manifest (kind "full"), written after the package is in place

A delta part is a flat ``{str: Tensor}`` dict (``torch.save``; C++ reads it with ``torch::pickle_load``)::

    "table/<name>/ids"       int64[n]              the table's rows this part replaces (after managed-collision remap)
    "table/<name>/rows"      uint8[n, row_bytes]   their bytes exactly as the package's table holds them
                                                   (artifact_rows: data, scale and bias, padding)
    "dense/<state_dict key>" Tensor                a non-table parameter or buffer of the training module, whole

A package records where each table's rows lie in its constants (``InferenceSpec.table_layout``) and which
training tensor each other constant is (``InferenceSpec.constant_sources``): a server writes ``rows[i]`` at byte
``offset + ids[i] * row_bytes`` of the table's constant and replaces each sourced constant by its ``dense/`` tensor.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_rec.errors import ServingError

__all__ = [
    "FORMAT",
    "LATEST_FILE",
    "Delta",
    "DeltaError",
    "Manifest",
    "artifact_rows",
    "decode_part",
    "encode_part",
    "file_record",
    "full_manifest_path",
    "full_path",
    "read_delta",
    "read_latest",
    "read_manifest",
    "row_bytes",
    "version_dir",
    "write_part",
]

FORMAT = "lightning_rec.publish/1"
LATEST_FILE = "LATEST"
MANIFEST_FILE = "manifest.json"
_PART = re.compile(r"delta\.r(\d+)\.pt")
_CHUNK = 1 << 20
_KINDS = ("delta", "full")


class DeltaError(ServingError):
    """A published version that cannot be served: a missing or damaged file (named with the version), a manifest
    that does not fit the format, or a delta that does not fit the package it would update. A server that follows
    the publish directory keeps serving its last good version."""


# ---- names -------------------------------------------------------------------------------------------------------


def version_dir(root: str | Path, version: int) -> Path:
    """``root/versions/v000007``: the folder of ``version``."""
    return Path(root) / "versions" / f"v{version:06d}"


def full_path(root: str | Path, version: int) -> Path:
    """``root/full/v000005.pt2``: the full package published at ``version``."""
    return Path(root) / "full" / f"v{version:06d}.pt2"


def full_manifest_path(root: str | Path, version: int) -> Path:
    """``root/full/v000005.json``: the manifest of the full package at ``version``."""
    return Path(root) / "full" / f"v{version:06d}.json"


def read_latest(root: str | Path) -> int | None:
    """The version ``root/LATEST`` points at, ``None`` when nothing was published yet.

    Raises:
        DeltaError: the pointer is not ``{"version": <positive int>}``.
    """
    path = Path(root) / LATEST_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        version = json.loads(text)["version"]
    except (ValueError, KeyError, TypeError) as err:
        raise DeltaError(f'{str(path)!r} is not {{"version": <int>}}: {type(err).__name__}: {err}') from None
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise DeltaError(f"{str(path)!r} points at version {version!r}; expected a positive integer.")
    return version


# ---- the bytes of a table row ------------------------------------------------------------------------------------

# The quantized kernels' row alignment on CPU (TorchRec's QuantEmbeddingBagCollection default, DEFAULT_ROW_ALIGNMENT)
_ROW_ALIGNMENT = 16


def _sparse_type(table_dtype: str) -> Any:
    from fbgemm_gpu.split_embedding_configs import SparseType

    types = {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8, "int4": SparseType.INT4}
    if table_dtype not in types:
        raise ValueError(f"table_dtype must be one of {sorted(types)}, got {table_dtype!r}")
    return types[table_dtype]


def row_bytes(dim: int, table_dtype: str, row_alignment: int = _ROW_ALIGNMENT) -> int:
    """The bytes one row of ``dim`` columns takes in FBGEMM's quantized table as ``table_dtype`` (data, the fp16
    scale and bias of int8/int4 rows, padding to ``row_alignment``): FBGEMM's own ``rounded_row_size_in_bytes``.

    Example::

        >>> row_bytes(64, "int8"), row_bytes(64, "fp32"), row_bytes(4, "int8")
        (80, 256, 16)
    """
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import rounded_row_size_in_bytes

    return int(rounded_row_size_in_bytes(dim, _sparse_type(table_dtype), row_alignment, 4))


def artifact_rows(float_rows: Tensor, table_dtype: str, *, row_alignment: int = _ROW_ALIGNMENT) -> Tensor:
    """The bytes an exported package's table holds for ``float_rows`` (the training table's rows, ``[n, dim]``
    float32), ``uint8[n, row_bytes]``: TorchRec's own quantization (``quantize_state_dict``, what
    ``export_inference`` runs) into FBGEMM's own table (``IntNBitTableBatchedEmbeddingBagsCodegen``, its
    ``split_embedding_weights``), so a row is bit for bit the one a full export of the same weights holds. Each row
    is quantized on its own (int8/int4: its own scale and bias), so any subset of a table's rows gives the same
    bytes as the whole table.

    Example::

        >>> rows = artifact_rows(torch.randn(3, 8), "int8")
        >>> rows.dtype, tuple(rows.shape)
        (torch.uint8, (3, 16))
    """
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
    from torchrec.modules.embedding_configs import DataType
    from torchrec.quant.embedding_modules import quantize_state_dict

    sparse_type = _sparse_type(table_dtype)
    if float_rows.dim() != 2:
        raise ValueError(f"float_rows must be [rows, dim], got shape {list(float_rows.shape)}")
    n, dim = float_rows.shape
    width = row_bytes(dim, table_dtype, row_alignment)
    if n == 0:
        return torch.empty(0, width, dtype=torch.uint8)
    # quantize_state_dict reads a module's "<table>.weight" entries, as TorchRec's from_float hands it a collection
    table = torch.nn.Module()
    table.register_buffer("weight", float_rows.detach().float().contiguous())
    holder = torch.nn.Module()
    holder.add_module("rows", table)
    quantized: dict[str, tuple[Tensor, Tensor]] = {}
    quantize_state_dict(holder, quantized, {"rows": DataType(table_dtype.upper())})
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[("rows", n, dim, sparse_type, EmbeddingLocation.HOST)],
        weight_lists=[quantized["rows"]],
        device="cpu",
        output_dtype=SparseType.FP32,
        row_alignment=row_alignment,
    )
    (held, _), *_ = tbe.split_embedding_weights(split_scale_shifts=False)
    assert held.shape == (n, width), (held.shape, width)
    return held.clone()


# ---- delta parts -------------------------------------------------------------------------------------------------


def encode_part(tables: Mapping[str, tuple[Tensor, Tensor]], dense: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A delta part's flat dict: ``tables`` (name -> ``(ids int64[n], rows uint8[n, row_bytes])``, the rows from
    :func:`artifact_rows`) and ``dense`` (training ``state_dict`` key -> tensor), each tensor a compact copy (a view
    would save its whole storage)."""
    part: dict[str, Tensor] = {}
    for name, (ids, rows) in tables.items():
        if "/" in name:
            raise ValueError(f"table name {name!r} holds '/', which the delta's keys use as a separator")
        if ids.dim() != 1 or rows.dim() != 2 or ids.numel() != rows.shape[0] or rows.dtype != torch.uint8:
            raise ValueError(
                f"table {name!r}: ids must be int64[n] and rows uint8[n, row_bytes]; got ids {list(ids.shape)} "
                f"{ids.dtype}, rows {list(rows.shape)} {rows.dtype}"
            )
        part[f"table/{name}/ids"] = _compact(ids.long())
        part[f"table/{name}/rows"] = _compact(rows)
    for key, tensor in dense.items():
        part[f"dense/{key}"] = _compact(tensor.detach())
    return part


def _compact(tensor: Tensor) -> Tensor:
    return tensor.detach().cpu().contiguous().clone()


def write_part(path: str | Path, tables: Mapping[str, tuple[Tensor, Tensor]], dense: Mapping[str, Tensor]) -> dict:
    """Write a delta part (:func:`encode_part`) to ``path`` with ``torch.save``; returns its :func:`file_record`."""
    path = Path(path)
    torch.save(encode_part(tables, dense), path)
    return file_record(path)


@dataclass
class Delta:
    """A version's delta, its parts merged: ``tables`` name -> ``(ids, rows)``, ``dense`` key -> tensor."""

    manifest: Manifest
    tables: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    dense: dict[str, Tensor] = field(default_factory=dict)


def decode_part(part: Mapping[str, Any], name: str = "delta part") -> tuple[dict, dict]:
    """``(tables, dense)`` of a delta part's flat dict (as :func:`encode_part` made it), checked: every table has
    int64 ids and uint8 rows of as many rows; anything else is a :class:`DeltaError` naming ``name`` and the key."""
    ids: dict[str, Tensor] = {}
    rows: dict[str, Tensor] = {}
    dense: dict[str, Tensor] = {}
    for key, value in part.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise DeltaError(f"{name}: entry {key!r} is not a string key with a tensor")
        kind, _, rest = key.partition("/")
        if kind == "dense" and rest:
            dense[rest] = value
            continue
        table, _, what = rest.rpartition("/")
        if kind != "table" or not table or what not in ("ids", "rows"):
            raise DeltaError(f"{name}: unknown key {key!r} (expected 'table/<name>/ids|rows' or 'dense/<key>')")
        (ids if what == "ids" else rows)[table] = value
    tables = {}
    for table in sorted(set(ids) | set(rows)):
        if table not in ids or table not in rows:
            raise DeltaError(f"{name}: table {table!r} has {'ids' if table in ids else 'rows'} but no partner")
        i, r = ids[table], rows[table]
        if i.dtype != torch.int64 or i.dim() != 1 or r.dtype != torch.uint8 or r.dim() != 2 or len(i) != len(r):
            raise DeltaError(
                f"{name}: table {table!r}: ids must be int64[n] and rows uint8[n, row_bytes]; got ids "
                f"{list(i.shape)} {i.dtype}, rows {list(r.shape)} {r.dtype}"
            )
        tables[table] = (i, r)
    return tables, dense


# ---- manifests ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """A published version's ``manifest.json`` (a full package's ``full/vNNNNNN.json``, with ``kind="full"``).

    Args:
        version: the version (1, 2, ...).
        kind: ``"delta"`` (``versions/vNNNNNN/``) or ``"full"`` (``full/vNNNNNN.pt2``).
        previous: the version a delta applies on (``version - 1``), ``None`` for version 1.
        step: the training step (``global_step``) published.
        event_time: the latest event time trained on (the stream's timestamp), ``None`` when unknown.
        epoch: the training epoch.
        world_size: the ranks that wrote it (one delta part each).
        table_dtype: the tables' dtype in the packages the deltas apply to.
        created: when it was written (ISO 8601).
        files: file name (in the version's folder; for a full, the package's name) -> ``{"bytes", "sha256"}``.
        format: the directory's format, ``"lightning_rec.publish/1"``.
    """

    version: int
    kind: str
    previous: int | None
    step: int
    event_time: Any
    epoch: int
    world_size: int
    table_dtype: str
    created: str
    files: dict[str, dict[str, Any]]
    format: str = FORMAT

    def to_json(self) -> str:
        """The manifest as written (keys in a fixed order)."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, record: Any, where: str) -> Manifest:
        """A manifest from its JSON ``record``, checked; a :class:`DeltaError` naming ``where`` otherwise."""
        if not isinstance(record, dict):
            raise DeltaError(f"{where}: the manifest is not a JSON object")
        if record.get("format") != FORMAT:
            raise DeltaError(f"{where}: format {record.get('format')!r}; this lightning_rec reads {FORMAT!r}")
        names = {f for f in cls.__dataclass_fields__}
        missing = sorted(names - set(record))
        if missing:
            raise DeltaError(f"{where}: the manifest lacks {missing}")
        manifest = cls(**{k: record[k] for k in names})
        if not isinstance(manifest.version, int) or manifest.version < 1 or manifest.kind not in _KINDS:
            raise DeltaError(f"{where}: version {manifest.version!r} / kind {manifest.kind!r} is not valid")
        for file, entry in manifest.files.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or "sha256" not in entry:
                raise DeltaError(f"{where}: files[{file!r}] is not {{'bytes': int, 'sha256': hex}}")
        return manifest


def read_manifest(path: str | Path) -> Manifest:
    """The :class:`Manifest` at ``path``; a missing or malformed one is a :class:`DeltaError` naming it."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise DeltaError(f"{str(path)!r} is missing") from None
    except (ValueError, OSError) as err:
        raise DeltaError(f"{str(path)!r} cannot be read: {type(err).__name__}: {err}") from None
    return Manifest.from_dict(record, repr(str(path)))


def file_record(path: str | Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of the file at ``path``: its entry in a :class:`Manifest`'s ``files``."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def check_file(path: Path, entry: Mapping[str, Any], where: str) -> None:
    """Refuse (:class:`DeltaError` naming ``where`` and the file) a file that is missing or whose size or SHA-256 is
    not its manifest ``entry``'s."""
    if not path.is_file():
        raise DeltaError(f"{where}: {path.name} is missing ({str(path)!r})")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise DeltaError(f"{where}: {path.name} holds {size} bytes; its manifest records {entry['bytes']}")
    found = file_record(path)["sha256"]
    if found != entry["sha256"]:
        raise DeltaError(
            f"{where}: {path.name} has SHA-256 {found[:16]}..., its manifest records {str(entry['sha256'])[:16]}... "
            "(damaged in writing or copying)"
        )


def read_delta(root: str | Path, version: int) -> Delta:
    """Read and check ``version``'s delta in the publish directory ``root``: its manifest (format, version, kind),
    every file it lists (size and SHA-256) and every part (keys, dtypes, shapes); the parts' rows merged per table.

    Raises:
        DeltaError: naming the version and the file that is missing, damaged or malformed.

    Example::

        delta = read_delta("publish/", 7)
        ids, rows = delta.tables["t_user"]       # rows: uint8[n, row_bytes], the package's own bytes
    """
    folder = version_dir(root, version)
    where = f"version {version} ({str(folder)!r})"
    if not folder.is_dir():
        raise DeltaError(f"{where}: the version's folder is missing")
    manifest = read_manifest(folder / MANIFEST_FILE)
    if manifest.version != version or manifest.kind != "delta":
        raise DeltaError(f"{where}: its manifest is version {manifest.version} kind {manifest.kind!r}")
    parts = sorted(f for f in manifest.files if _PART.fullmatch(f))
    if not parts:
        raise DeltaError(f"{where}: its manifest lists no delta part (delta.r<rank>.pt)")
    for file, entry in manifest.files.items():
        check_file(folder / file, entry, where)
    delta = Delta(manifest)
    for file in parts:
        try:
            part = torch.load(folder / file, map_location="cpu", weights_only=True)
        except Exception as err:  # torch.load raises many types on a malformed file
            raise DeltaError(f"{where}: {file} cannot be read: {type(err).__name__}: {err}") from None
        if not isinstance(part, dict):
            raise DeltaError(f"{where}: {file} is not a dict of tensors")
        tables, dense = decode_part(part, f"{where}: {file}")
        for table, (ids, rows) in tables.items():
            if table in delta.tables:
                old_ids, old_rows = delta.tables[table]
                ids, rows = torch.cat([old_ids, ids]), torch.cat([old_rows, rows])
            delta.tables[table] = (ids, rows)
        for key, tensor in dense.items():
            delta.dense.setdefault(key, tensor)  # every rank writes the same dense weights
    return delta
