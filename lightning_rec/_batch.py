"""The batch type and how batches are built from per-sample rows.

``Batch`` is TorchRec's own (``torchrec.datasets.utils.Batch``: dense features, a ``KeyedJaggedTensor`` of
sparse features, labels). It moves with ``.to(device)``; plain dicts and tuples holding a ``KeyedJaggedTensor``
transfer the same way. :func:`to_device` moves any of them without blocking the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities.model_helpers import is_overridden
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from lightning_rec import _compat

__all__ = ["RowCollator", "collate_rows", "custom_batch_hooks", "to_device"]

SparseValue = int | Sequence[int] | torch.Tensor


def collate_rows(
    rows: Sequence[Mapping[str, Any]],
    sparse_keys: Sequence[str],
    *,
    dense_key: str = "dense",
    sparse_key: str = "sparse",
    label_key: str = "label",
) -> Batch:
    """Build a :class:`Batch` from per-sample rows.

    Each row is a mapping ``{"dense": [floats], "sparse": {feature: id or [ids]}, "label": float}``. A feature
    may hold one id, several (multi-hot) or none; a feature missing from a row counts as no ids.

    Args:
        rows: the samples.
        sparse_keys: the feature names, in the order the KeyedJaggedTensor should hold them.
        dense_key, sparse_key, label_key: the row keys of the three parts.

    Returns:
        a ``Batch`` whose ``sparse_features`` is laid out feature-major, as TorchRec expects::

                       sample 0    sample 1
            "user"     [7]         [3]
            "genre"    [1, 4]      []

            values  = [7, 3, 1, 4]   lengths = [1, 1, 2, 0]

    Example::

        >>> b = collate_rows([{"dense": [0.5], "sparse": {"user": 7, "genre": [1, 4]}, "label": 1.0},
        ...                   {"dense": [0.1], "sparse": {"user": 3}, "label": 0.0}], ["user", "genre"])
        >>> b.sparse_features.lengths().tolist()
        [1, 1, 2, 0]
    """
    if not rows:
        raise ValueError("collate_rows: got no rows; a batch needs at least one sample.")
    values: list[int] = []
    lengths: list[int] = []
    for key in sparse_keys:
        for i, row in enumerate(rows):
            ids = row.get(sparse_key, {}).get(key, ())
            if isinstance(ids, torch.Tensor):
                ids = ids.reshape(-1).tolist()
            elif isinstance(ids, int):
                ids = (ids,)
            ids = list(ids)
            if any(not isinstance(v, int) or isinstance(v, bool) for v in ids):
                raise TypeError(f"collate_rows: row {i}, feature {key!r}: ids must be ints, got {ids!r}.")
            values.extend(ids)
            lengths.append(len(ids))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(sparse_keys),
        values=torch.tensor(values, dtype=torch.long),
        lengths=torch.tensor(lengths, dtype=torch.int32),
    )
    dense = torch.tensor([list(row.get(dense_key, ())) for row in rows], dtype=torch.float32)
    labels = torch.tensor([float(row[label_key]) for row in rows], dtype=torch.float32)
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


@dataclass
class RowCollator:
    """A picklable ``collate_fn`` for ``DataLoader`` (works with ``num_workers > 0``).

    Example::

        loader = DataLoader(rows, batch_size=256, collate_fn=RowCollator(["user", "item"]), num_workers=2)
    """

    sparse_keys: Sequence[str]
    dense_key: str = "dense"
    sparse_key: str = "sparse"
    label_key: str = "label"

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> Batch:
        return collate_rows(
            rows, self.sparse_keys, dense_key=self.dense_key, sparse_key=self.sparse_key, label_key=self.label_key
        )


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (any collection of tensors, KJTs, TorchRec ``Batch`` objects and anything else with ``.to``) on
    ``device``, copied without blocking the host when ``device`` is an accelerator.

    Lightning's ``move_data_to_device`` passes ``non_blocking=True`` to plain tensors only, so a TorchRec ``Batch`` or
    ``KeyedJaggedTensor`` is copied blocking (the host waits for the copy and for everything queued before it).
    From pinned memory (``DataLoader(pin_memory=True)``) a non-blocking copy overlaps the device's work.

    Example::

        >>> to_device({"dense": torch.ones(2)}, torch.device("cpu"))["dense"]
        tensor([1., 1.])
    """
    non_blocking = device.type != "cpu"  # a non-blocking copy *to* the host could be read before it lands

    def move(data: Any) -> Any:
        if isinstance(data, (torch.Tensor, Pipelineable)):
            return data.to(device, non_blocking=non_blocking)
        return data.to(device)

    return apply_to_collection(batch, _compat._TransferableDataType, move)


def custom_batch_hooks(module: Any, datamodule: Any | None = None) -> tuple[bool, bool]:
    """Whether ``module`` or ``datamodule`` overrides Lightning's ``transfer_batch_to_device`` and
    ``on_after_batch_transfer`` hooks (read once per run: calling Lightning's default hooks costs Python per step).

    Example::

        >>> import lightning as L
        >>> custom_batch_hooks(L.LightningModule())
        (False, False)
    """

    def overridden(name: str) -> bool:
        return is_overridden(name, module) or (datamodule is not None and is_overridden(name, datamodule))

    return overridden("transfer_batch_to_device"), overridden("on_after_batch_transfer")
