"""Start embedding tables from given rows (pretrained embeddings, another model's tables, a file) on any plan.

A table's rows are placed in the *unsharded* module, before ``fit``; the strategy then copies every rank's shards
out of them when it shards (row-wise, column-wise, table-wise, data-parallel alike: see
:mod:`lightning_rec._strategy.unsharded`), so the same call works on 1 process or 64 and under any plan::

    model = MyModel()                                        # tables on meta: no memory yet
    load_rows(model, {"t_item": "item_rows.npy",              # a file of rows (memory-mapped)
                      "t_user": torch.randn(944, 16) * 0.01}) # or a tensor
    L.Trainer(strategy="recshard", devices=2).fit(model, dm)

or, from a config, the :class:`~lightning_rec.callbacks.PretrainedRows` callback. A table built on CPU keeps its
own rows the same way, with nothing to call.

Files: ``.npy`` (memory-mapped), ``.safetensors``, or a ``torch.save`` file (loaded with ``weights_only=True``,
memory-mapped). A file holds one tensor, or several keyed by table name or by state-dict key (so the output of
``lightning-rec export`` works as is: the key ending in ``.<table>.weight`` is taken).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Union

import numpy as np
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection

from lightning_rec._tables import embedding_modules, inner_collection

__all__ = ["Rows", "load_rows", "read_rows"]

Rows = Union[torch.Tensor, np.ndarray, str, "os.PathLike[str]"]


def read_rows(source: str | os.PathLike[str], table: str) -> torch.Tensor:
    """The rows of ``table`` stored in the file ``source`` (``.npy``, ``.safetensors`` or a ``torch.save`` file).

    Args:
        source: the file.
        table: the table's name; picks the tensor when the file holds several.

    Raises:
        ValueError: if the file holds several tensors and none (or more than one) is the table's.

    Example::

        rows = read_rows("runs/export/model.safetensors", "t_item_id")   # the key "...t_item_id.weight"
    """
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"load_rows: table {table!r}: no file {path}.")
    if path.suffix == ".npy":
        # Copy-on-write mapping: pages are read when a shard is copied out, never written back to the file.
        return torch.from_numpy(np.load(path, mmap_mode="c"))
    if path.suffix == ".safetensors":
        import safetensors.torch

        stored: torch.Tensor | dict[str, torch.Tensor] = safetensors.torch.load_file(str(path))
    else:
        stored = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(stored, torch.Tensor):
        return stored
    if not isinstance(stored, Mapping):
        raise ValueError(
            f"load_rows: table {table!r}: {path} holds a {type(stored).__name__}, not a tensor or a dict of tensors."
        )
    if table in stored:
        return stored[table]
    matches = [k for k in stored if k.endswith(f".{table}.weight")]
    if len(stored) == 1:
        matches = list(stored)
    if len(matches) != 1:
        keys = ", ".join(sorted(stored)[:8]) + (" ..." if len(stored) > 8 else "")
        raise ValueError(
            f"load_rows: table {table!r}: {path} holds {len(stored)} tensors and "
            f"{'none' if not matches else len(matches)} of them is keyed {table!r} or '*.{table}.weight' ({keys}). "
            "HINT: save the rows as one tensor, or keyed by the table's name."
        )
    return stored[matches[0]]


def table_holders(module: nn.Module) -> dict[str, list[tuple[str, nn.Embedding | nn.EmbeddingBag, int, int]]]:
    """Table name -> every (module path, its nn.Embedding(Bag), rows, columns) that declares it."""
    found: dict[str, list[tuple[str, nn.Embedding | nn.EmbeddingBag, int, int]]] = {}
    for path, sub in embedding_modules(module).items():
        inner = inner_collection(sub)  # a position-weighted or managed-collision module's tables are its collection's
        if isinstance(inner, EmbeddingBagCollection):
            configs, holders = inner.embedding_bag_configs(), inner.embedding_bags
        elif isinstance(inner, EmbeddingCollection):
            configs, holders = inner.embedding_configs(), inner.embeddings
        else:  # pragma: no cover - only TorchRec's table modules are searched
            continue
        for config in configs:
            found.setdefault(config.name, []).append(
                (path, holders[config.name], config.num_embeddings, config.embedding_dim)
            )
    return found


@torch.no_grad()
def load_rows(module: nn.Module, rows: Mapping[str, Rows]) -> None:
    """Give the named tables of ``module``'s unsharded ``EmbeddingBagCollection``/``EmbeddingCollection``\\ s these
    rows, before training shards them; any plan then starts from them.

    A table still on ``meta`` gets the rows as its weight (a memory-mapped file is read only where shards are
    copied out of it); a table already allocated has them copied in. Everything is checked first (every table
    named exists once, every tensor has its table's shape and finite values), so on an error nothing changed.

    Args:
        module: the model (or any module holding the embedding modules), not yet sharded.
        rows: table name -> a ``(num_embeddings, embedding_dim)`` tensor/array, or a file (see :func:`read_rows`).

    Raises:
        KeyError: an unknown table, or a name that several embedding modules declare.
        ValueError: a shape that is not the table's, a non-finite value, or an already-sharded module.

    Example::

        >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        >>> ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        ...     name="t_item", embedding_dim=4, num_embeddings=3, feature_names=["item"])], device=torch.device("meta"))
        >>> load_rows(ebc, {"t_item": torch.ones(3, 4)})
        >>> ebc.embedding_bags["t_item"].weight.sum().item()
        12.0
    """
    tables = table_holders(module)
    if not tables and list(rows):
        raise ValueError(
            f"load_rows: {type(module).__name__} holds no unsharded EmbeddingBagCollection/EmbeddingCollection. "
            "HINT: call it on the model before fit (a sharded module's tables are filled from a checkpoint instead)."
        )
    staged: list[tuple[str, nn.Embedding | nn.EmbeddingBag, torch.Tensor]] = []
    for name, source in rows.items():
        where = tables.get(name)
        if not where:
            raise KeyError(f"load_rows: no table {name!r}; the model's tables: {', '.join(sorted(tables))}.")
        if len(where) > 1:
            raise KeyError(
                f"load_rows: table name {name!r} is declared by {len(where)} modules ({', '.join(p or '<root>' for p, *_ in where)}). "
                "HINT: call load_rows on the one module that should get the rows."
            )
        path, holder, num_rows, dim = where[0]
        tensor = read_rows(source, name) if isinstance(source, (str, os.PathLike)) else torch.as_tensor(source)
        if tuple(tensor.shape) != (num_rows, dim):
            raise ValueError(
                f"load_rows: table {name!r} ({path or '<root>'}) has {num_rows} rows of {dim} values; the rows given are "
                f"{tuple(tensor.shape)}. HINT: num_embeddings and embedding_dim of its config must match the rows."
            )
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"load_rows: table {name!r}: rows must be floating point, got {tensor.dtype}.")
        bad = ~torch.isfinite(tensor)
        if bool(bad.any()):
            row = int(bad.any(dim=1).nonzero()[0])
            raise ValueError(
                f"load_rows: table {name!r}: row {row} holds a non-finite value ({tensor[row][bad[row]][0].item()})."
            )
        staged.append((name, holder, tensor))
    for _, holder, tensor in staged:
        weight = holder.weight
        if weight.is_meta:
            holder.weight = nn.Parameter(tensor.to(weight.dtype), requires_grad=weight.requires_grad)
        else:
            weight.copy_(tensor)
