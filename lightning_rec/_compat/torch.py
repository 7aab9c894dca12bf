"""torch's private names recshard relies on (ShardedTensor and the dispatch-mode base class are imported by the
package's ``__init__``): the default store, a tensor's version counter, ``Tensor.to``'s argument parser,
AOTInductor's compiler search."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def default_store() -> torch.distributed.Store | None:
    """The default process group's key-value store, or ``None`` without a process group. torch keeps it private
    (``_get_default_store``); :mod:`lightning_rec._strategy.faults` uses it so that a failing rank can tell the others why,
    without opening a second rendezvous."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def tensor_version(tensor: torch.Tensor) -> int:
    """How many times ``tensor`` (or a view of its storage) was changed in place: torch's autograd version counter,
    public in behaviour but underscore-named (``Tensor._version``). The input checks use it to notice a checked
    KJT changed in place inside ``forward``. An inference tensor (made under ``torch.inference_mode``, e.g. the batch
    ``trainer.predict`` copies to a GPU) keeps no counter: -2, which no recorded version equals."""
    return -2 if tensor.is_inference() else tensor._version


# torch: what `Tensor.to(*args, **kwargs)` was asked for (device, dtype, non_blocking, memory_format), parsed as torch
# parses it; the one parser of every `to` signature (device, dtype, other tensor, keywords) is private.
def parse_to(*args: Any, **kwargs: Any) -> tuple:
    """``(device, dtype, non_blocking, memory_format)`` of a ``Tensor.to`` call's arguments."""
    import torch

    return torch._C._nn._parse_to(*args, **kwargs)


def cpp_compiler() -> str | Exception:
    """The C++ compiler AOTInductor will call, or why there is none (its own search: ``CXX``, then ``g++``)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return get_cpp_compiler()
    except Exception as err:  # InvalidCxxCompiler, or a failed probe of the compiler
        return err
