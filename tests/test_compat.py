"""The one seam for patches of TorchRec's and FBGEMM's objects (``lightning_rec._compat.patch_method``), pinned to
the installed versions: every method it may patch still exists, and a patch goes back to what was there."""

from __future__ import annotations

import importlib

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn

from lightning_rec import _compat


@pytest.mark.parametrize("name", sorted(_compat.PATCHED_METHODS))
def test_every_patched_method_exists_in_the_installed_torchrec_and_fbgemm(name):
    module, cls = _compat.PATCHED_METHODS[name]
    assert callable(getattr(getattr(importlib.import_module(module), cls), name, None)), (module, cls, name)


def _tbe() -> SplitTableBatchedEmbeddingBagsCodegen:
    spec = (10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)
    return SplitTableBatchedEmbeddingBagsCodegen([spec], optimizer=EmbOptimType.EXACT_SGD)


def test_a_patch_shadows_the_method_and_unpatching_restores_what_was_there():
    tbe = _tbe()
    ids, offsets = torch.tensor([1, 2]), torch.tensor([0, 2])
    expected = tbe(ids, offsets).detach()
    _compat.patch_method(tbe, "forward", lambda *args, **kwargs: "patched")
    assert tbe(ids, offsets) == "patched" and _compat.is_patched(tbe, "forward")
    assert torch.equal(_compat.original_method(tbe, "forward")(ids, offsets).detach(), expected)
    _compat.patch_method(tbe, "forward", lambda *args, **kwargs: "again")  # a second patch replaces the first
    _compat.unpatch_method(tbe, "forward")
    assert torch.equal(tbe(ids, offsets).detach(), expected) and "forward" not in vars(tbe)
    # Someone else's instance attribute is kept as the original, and put back.
    theirs = lambda *args, **kwargs: "theirs"  # noqa: E731
    object.__setattr__(tbe, "forward", theirs)
    _compat.patch_method(tbe, "forward", lambda *args, **kwargs: "ours")
    assert _compat.original_method(tbe, "forward") is theirs
    _compat.unpatch_method(tbe, "forward")
    assert tbe(ids, offsets) == "theirs"


def test_the_seam_refuses_what_it_was_not_written_for():
    with pytest.raises(TypeError, match="patches ShardedModule instances, got Linear"):
        _compat.patch_method(nn.Linear(2, 2), "input_dist", lambda *a: None)
    with pytest.raises(KeyError, match="does not patch 'backward'"):
        _compat.patch_method(_tbe(), "backward", lambda *a: None)
    assert not _compat.patchable(nn.Linear(2, 2), "compute_and_output_dist")

    class Renamed(SplitTableBatchedEmbeddingBagsCodegen):  # a release that no longer has the method
        forward = None  # type: ignore[assignment]

    renamed = _tbe()
    renamed.__class__ = Renamed
    with pytest.raises(AttributeError, match="Renamed has no method 'forward'"):
        _compat.patch_method(renamed, "forward", lambda *a: None)


@pytest.mark.parametrize("key", sorted(_compat.PATCHED_CLASS_ATTRIBUTES))
def test_every_patched_class_attribute_exists_in_the_installed_torchrec(key):
    cls_name, attr = key.split(".")
    cls = getattr(importlib.import_module(_compat.PATCHED_CLASS_ATTRIBUTES[key]), cls_name)
    assert attr in vars(cls), key


def test_the_uneven_batch_patch_is_installed_once_delegates_and_can_be_undone():
    from torchrec.distributed.comm_ops import ReduceScatterV_Wait

    from lightning_rec._strategy.uneven_batches import allow_uneven_batches_over_gloo

    key = "ReduceScatterV_Wait.backward"
    was_patched = _compat.is_class_attribute_patched(key)
    _compat.unpatch_class_attribute(key)
    original = vars(ReduceScatterV_Wait)["backward"]
    try:
        allow_uneven_batches_over_gloo()
        patched = vars(ReduceScatterV_Wait)["backward"]
        assert isinstance(patched, staticmethod) and patched is not original
        allow_uneven_batches_over_gloo()  # once per process: a second call changes nothing
        assert vars(ReduceScatterV_Wait)["backward"] is patched
        _compat.unpatch_class_attribute(key)
        assert vars(ReduceScatterV_Wait)["backward"] is original
    finally:
        if was_patched:
            allow_uneven_batches_over_gloo()
