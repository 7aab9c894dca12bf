"""Where a ``.pt2`` package keeps what training changes, recorded at export so that a server can update it in place
(:mod:`lightning_rec.serving.deltas`, :class:`~lightning_rec.serving.FreshModel`, ``examples/serve_cpp``):

- ``table_layout``: for each table, the package constant holding its rows (FBGEMM's flat ``uint8`` table buffer,
  shared by the tables of one kernel), the byte offset of its row 0 and the bytes from one row to the next, read
  from the kernel's own per-table views (``split_embedding_weights``);
- ``constant_sources``: for each other constant the package reads, the training ``state_dict`` key of the
  parameter or buffer it is (matched by storage: the very tensor, not a copy).

A constant with no source (the input checks' row counts, FBGEMM's offsets) never changes. The package keeps every
tensor as a constant (``always_keep_tensor_constants``): AOTInductor otherwise compiles a small one (a bias of up
to 8 values) into the code, where no update reaches it.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_rec.errors import ExportError

__all__ = [
    "check_layout",
    "constant_sources",
    "locate_tables",
    "name_tables",
    "read_table_bytes",
    "table_layout",
]

# The FBGEMM table buffers of an inference kernel (IntNBitTableBatchedEmbeddingBagsCodegen), by placement.
_TABLE_BUFFERS = ("weights_dev", "weights_host", "weights_uvm")


def _kernels(model: nn.Module) -> Iterable[tuple[str, Any]]:
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    for name, module in model.named_modules():
        if isinstance(module, IntNBitTableBatchedEmbeddingBagsCodegen):
            yield name, module


def name_tables(model: nn.Module) -> None:
    """Register each quantized kernel's table buffer (a plain attribute of FBGEMM's kernel) as a buffer of the
    kernel, so that ``torch.export`` and AOTInductor keep its name (``<kernel>.weights_host``) instead of an
    anonymous ``_tensor_constantN``: the package's constant is then found by name. The same tensor: the kernel
    reads it as before."""
    for _, kernel in _kernels(model):
        for attr in _TABLE_BUFFERS:
            tensor = kernel.__dict__.get(attr)
            if isinstance(tensor, Tensor) and tensor.numel() > 0:
                delattr(kernel, attr)
                kernel.register_buffer(attr, tensor, persistent=False)


def _key(tensor: Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())


def table_layout(model: nn.Module, table_dtype: str) -> dict[str, dict[str, Any]]:
    """Each table's place in ``model``'s quantized kernels: ``{"constant": the buffer's name in ``model``, "rows",
    "dim", "dtype", "offset": byte offset of row 0 in it, "row_bytes": bytes per row (the row stride)}``, from the
    kernel's own per-table views (after :func:`name_tables`)."""
    layout: dict[str, dict[str, Any]] = {}
    for prefix, kernel in _kernels(model):
        buffers = {
            attr: tensor
            for attr, tensor in kernel.named_buffers(recurse=False)
            if attr in _TABLE_BUFFERS and tensor.numel() > 0
        }
        views = kernel.split_embedding_weights(split_scale_shifts=False)
        for (view, _), spec in zip(views, kernel.embedding_specs):
            table, rows, dim = spec[0], spec[1], spec[2]
            holder = [
                a for a, b in buffers.items() if b.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
            ]
            if not holder or table in layout:
                raise ExportError(
                    f"table {table!r}: its rows are not in one named buffer of its kernel ({prefix or 'the model'}), "
                    "or two kernels hold a table of that name; the package cannot record where its rows lie."
                )
            base = buffers[holder[0]]
            layout[table] = {
                "constant": f"{prefix}.{holder[0]}" if prefix else holder[0],
                "rows": int(rows),
                "dim": int(dim),
                "dtype": table_dtype,
                "offset": int(view.storage_offset() - base.storage_offset()) * base.element_size(),
                "row_bytes": int(view.stride(0)) * view.element_size() if rows else 0,
                "constant_bytes": int(base.numel()) * base.element_size(),
            }
    return layout


# AOTInductor's binary blob holds the constants one after another, each starting at a multiple of this
# (AOTI_CONST_ALIGNMENT in torch/csrc/inductor/aoti_runtime/model_base.h)
_BLOB_ALIGNMENT = 64


def locate_tables(package: Path, layout: dict[str, dict[str, Any]], model: nn.Module) -> dict[str, dict[str, Any]]:
    """``layout`` with, for each table, where its constant's initial bytes lie in ``package``: ``"blob"`` (the
    record of AOTInductor's weights blob, named under the archive's root folder) and ``"blob_offset"`` (the byte
    offset of the constant in it), found by content (the constant's own bytes, from ``model``'s buffer, at one of the
    blob's aligned offsets): a server reads a table's bytes from there without asking the compiled code
    (:class:`~lightning_rec.serving.FreshModel`). Both ``None`` when the package keeps no such blob."""
    import numpy as np

    buffers = dict(model.named_buffers())
    found: dict[str, tuple[str | None, int | None]] = {}
    with zipfile.ZipFile(package) as archive:
        blobs = [
            i for i in archive.infolist() if i.filename.endswith(".blob") and i.compress_type == zipfile.ZIP_STORED
        ]
        for constant in {entry["constant"] for entry in layout.values()}:
            needle = buffers[constant].detach().contiguous().view(torch.uint8).numpy()
            found[constant] = (None, None)
            for info in blobs:
                start = _data_start(package, info)
                blob = np.memmap(package, dtype=np.uint8, mode="r", offset=start, shape=(info.file_size,))
                offset = _find_aligned(blob, needle)
                if offset is not None:
                    found[constant] = (info.filename.partition("/")[2], offset)
                    break
    return {
        table: {**entry, "blob": found[entry["constant"]][0], "blob_offset": found[entry["constant"]][1]}
        for table, entry in layout.items()
    }


def _data_start(path: Path, info: zipfile.ZipInfo) -> int:
    """The byte offset of a stored record's data in the zip file (after its local header)."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_length + extra_length


def _find_aligned(blob: Any, needle: Any) -> int | None:
    """The first aligned offset at which ``blob`` holds ``needle``'s bytes (any such offset holds the same bytes)."""
    import numpy as np

    n = needle.size
    usable = (blob.size // _BLOB_ALIGNMENT) * _BLOB_ALIGNMENT
    if n == 0 or usable == 0:
        return None
    heads = np.asarray(blob[:usable]).reshape(-1, _BLOB_ALIGNMENT)[:, : min(n, _BLOB_ALIGNMENT)]
    for row in np.flatnonzero((heads == needle[: heads.shape[1]]).all(axis=1)):
        offset = int(row) * _BLOB_ALIGNMENT
        if offset + n <= blob.size and np.array_equal(blob[offset : offset + n], needle):
            return offset
    return None


def read_table_bytes(package: str | Path, entry: dict[str, Any]) -> Tensor:
    """The initial bytes of a table's constant (``uint8[constant_bytes]``) read from ``package``'s weights blob at
    the place its ``table_layout`` entry records (:func:`locate_tables`)."""
    with zipfile.ZipFile(package) as archive:
        root = archive.infolist()[0].filename.partition("/")[0]
        info = archive.getinfo(f"{root}/{entry['blob']}")
    out = torch.empty(entry["constant_bytes"], dtype=torch.uint8)
    with open(package, "rb") as f:
        f.seek(_data_start(Path(package), info) + entry["blob_offset"])
        if f.readinto(out.numpy().data) != out.numel():
            raise ValueError(f"{str(package)!r}: its weights blob ends before the table's bytes")
    return out


def constant_sources(
    exported: torch.export.ExportedProgram, training: Mapping[str, Tensor], tables: Iterable[str]
) -> tuple[dict[str, str], list[str]]:
    """``{package constant: training state_dict key}`` for every parameter/buffer of ``exported`` that its graph
    reads and that is one of ``training``'s tensors (the same storage, offset, shape and strides); the table buffers
    (``tables``: :func:`table_layout`'s constants) are left out. Second: the training keys whose tensors the graph
    reads as anonymous constants (a tensor held in a plain dict, as TorchRec's position weights are), which the
    compiled package names ``_tensor_constantN``: no update can find them."""
    signature = exported.graph_signature
    used = {node.name for node in exported.graph.nodes if node.op == "placeholder" and node.users}
    by_key = {_key(t): k for k, t in training.items() if isinstance(t, Tensor) and t.numel() > 0}
    anonymous = sorted(
        by_key[_key(tensor)]
        for placeholder, name in signature.inputs_to_lifted_tensor_constants.items()
        if placeholder in used
        and isinstance(tensor := exported.constants.get(name), Tensor)
        and tensor.numel() > 0
        and _key(tensor) in by_key
    )
    return _named_sources(exported, by_key, tables, used), anonymous


def _named_sources(
    exported: torch.export.ExportedProgram, by_key: Mapping[tuple, str], tables: Iterable[str], used: set[str]
) -> dict[str, str]:
    signature = exported.graph_signature
    named = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    skip = set(tables)
    values = {**exported.state_dict, **exported.constants}
    sources = {}
    for placeholder, fqn in named.items():
        tensor = values.get(fqn)
        if placeholder not in used or fqn in skip or not isinstance(tensor, Tensor) or tensor.numel() == 0:
            continue
        key = by_key.get(_key(tensor))
        if key is not None:
            sources[fqn] = key
    return sources


def check_layout(constants: Iterable[str], layout: Mapping[str, Mapping[str, Any]], sources: Mapping[str, str]) -> None:
    """Refuse (``ExportError``) a compiled package whose ``constants`` (``get_constant_fqns()``) lack one that
    ``layout`` or ``sources`` record: an update could not reach it."""
    have = set(constants)
    missing = sorted({entry["constant"] for entry in layout.values()} - have) + sorted(set(sources) - have)
    if missing:
        raise ExportError(
            f"the compiled package holds no constant {missing[0]!r} ({len(missing)} missing), which its spec records "
            "as updatable (table_layout / constant_sources): AOTInductor folded it into the code. HINT: report it; "
            "export with this lightning_rec's defaults (always_keep_tensor_constants)."
        )
