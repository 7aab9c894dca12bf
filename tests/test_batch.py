"""Unit tests: building batches from rows, in the main process and in DataLoader workers."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_rec import Batch, RowCollator, collate_rows

ROWS = [
    {"dense": [0.5, 1.0], "sparse": {"user": 7, "genre": [1, 4]}, "label": 1.0},
    {"dense": [0.1, 0.0], "sparse": {"user": 3}, "label": 0.0},
]


def test_collate_rows_builds_a_feature_major_kjt():
    b = collate_rows(ROWS, ["user", "genre"])
    assert isinstance(b, Batch)
    assert b.sparse_features.keys() == ["user", "genre"]
    assert b.sparse_features.lengths().tolist() == [1, 1, 2, 0]
    assert b.sparse_features.values().tolist() == [7, 3, 1, 4]
    assert b.sparse_features["genre"].to_dense()[0].tolist() == [1, 4]
    assert b.dense_features.shape == (2, 2) and b.labels.tolist() == [1.0, 0.0]


def test_bad_rows_are_named():
    with pytest.raises(TypeError, match="row 0, feature 'user'"):
        collate_rows([{"sparse": {"user": [1.5]}, "label": 0}], ["user"])
    with pytest.raises(ValueError, match="no rows"):
        collate_rows([], ["user"])


def test_row_collator_works_in_dataloader_workers():
    loader = DataLoader(ROWS * 8, batch_size=4, num_workers=2, collate_fn=RowCollator(["user", "genre"]))
    batches = list(loader)
    assert len(batches) == 4
    assert all(b.sparse_features.lengths().tolist() == [1, 1, 1, 1, 2, 0, 2, 0] for b in batches)
    moved = batches[0].to(torch.device("cpu"))
    assert torch.equal(moved.sparse_features.values(), batches[0].sparse_features.values())


def test_to_device_copies_torchrec_objects_without_blocking_to_an_accelerator_only():
    """Lightning passes ``non_blocking`` to plain tensors only; ``to_device`` passes it to TorchRec's ``Batch``, KJTs
    and any ``Pipelineable`` too, and never for a copy to the host (which could be read before it lands)."""
    from torchrec.streamable import Pipelineable

    from lightning_rec._batch import to_device

    class Recorder(Pipelineable):
        def __init__(self) -> None:
            self.calls = []

        def to(self, device, non_blocking=False):
            self.calls.append((device.type, non_blocking))
            return self

        def record_stream(self, stream) -> None:
            pass

    item = Recorder()
    to_device({"batch": [item]}, torch.device("cuda"))  # a device object needs no GPU
    to_device((item,), torch.device("cpu"))
    assert item.calls == [("cuda", True), ("cpu", False)]
    moved = to_device({"dense": torch.ones(2)}, torch.device("meta"))
    assert moved["dense"].device.type == "meta"
