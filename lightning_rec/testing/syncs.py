"""Count device-to-host synchronisations.

On a GPU every op whose result the host must read (an ``.item()``, a ``bool()`` of a tensor, a data-dependent
shape like ``nonzero``, a copy to host memory the host then reads) makes the host wait for the device, so every
microsecond of Python after it lands on the device's timeline. On CPU the same ops cost nothing, which hides them:
:class:`SyncCounter` counts them on any device, so a CPU test can guard a GPU property.

It counts two kinds:

- **ops** torch dispatches (seen by a dispatch mode): ``_local_scalar_dense`` (``.item()``, ``float()``, ``bool()``,
  ``torch.allclose``), ``is_nonzero``, ``equal``, ``nonzero``, ``masked_select``, the ``unique`` family,
  ``bincount``, ``repeat_interleave`` with tensor repeats and no ``output_size``, indexing and ``index_put_`` with a
  boolean mask (each needs the mask's count on the host);
- **reads into host memory** that dispatch nothing on a CPU tensor (wrapped while the counter is entered):
  ``Tensor.tolist``, ``Tensor.cpu``, ``Tensor.numpy`` and ``np.asarray``/``__array__``, and ``Tensor.to`` to the CPU
  without ``non_blocking=True``.

What it cannot tell on CPU is host memory from device memory: a read of a tensor that already lives on the host (a
batch before its copy to the device) is counted as if it lived on the device. Tests name such reads by their origin
(the file and function that asked, :attr:`SyncCounter.origins`) and pin them.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_rec import _compat

__all__ = ["SyncCounter"]

_aten = torch.ops.aten
# Ops whose output the host must read from the device (values, or a data-dependent shape).
SYNC_OPS = frozenset(
    {
        _aten._local_scalar_dense.default,  # .item(), float(t), int(t), bool(t)
        _aten.is_nonzero.default,
        _aten.equal.default,
        _aten.nonzero.default,
        _aten.masked_select.default,
        _aten._unique2.default,
        _aten.unique_consecutive.default,
        _aten.unique_dim.default,
        _aten.bincount.default,
        _aten.allclose.default,  # returns a Python bool (its `.item()` runs inside the op, unseen)
    }
)
_BOOL_INDEX_OPS = frozenset({_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default})
_THIS_FILE = str(Path(__file__).resolve())
# torch's own plumbing between an op and the mode (dynamo's disable wrapper, the dispatch-mode helpers).
_PLUMBING = ("torch/_dynamo/", "torch/_compile.py", "torch/utils/_python_dispatch.py")


def _origin() -> tuple[str, int, str]:
    """The innermost Python frame that is neither this module nor torch's dispatch plumbing: (file, line, function)."""
    for frame in reversed(traceback.extract_stack()):
        if (
            frame.filename != _THIS_FILE
            and str(Path(frame.filename).resolve()) != _THIS_FILE
            and not any(part in frame.filename for part in _PLUMBING)
        ):
            return frame.filename, frame.lineno or 0, frame.name
    return "?", 0, "?"


class SyncCounter(_compat.TorchDispatchMode):
    """Counts the synchronising ops run while it is active, and where each was asked for.

    The reads into host memory that dispatch no op (``tolist``, ``cpu``, ``numpy``, ``__array__``, a blocking
    ``to("cpu")``) are counted by wrapping those methods while the counter is entered. The origin of a sync is the innermost Python frame that asked for it (for an op inside torch's own Python code, that
    frame is torch's). Set ``active = False`` to pause counting (e.g. outside the steps you measure).

    Example::

        >>> import torch
        >>> with SyncCounter() as syncs:
        ...     _ = torch.ones(3).sum().item()
        ...     _ = torch.arange(3).tolist()
        >>> syncs.count
        2
        >>> sorted(op for op, _ in syncs.origins)
        ['_local_scalar_dense', 'tolist']
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.active = True
        self.origins: Counter = Counter()  # (op, (file, line, function)) -> count
        self._saved: dict[str, Callable[..., Any]] = {}
        self._inside = False

    def record(self, op: str) -> None:
        if self.active:
            self.count += 1
            self.origins[(op, _origin())] += 1

    def count_from(self, path_part: str) -> int:
        """How many counted syncs were asked for by a frame whose file path contains ``path_part``."""
        return sum(n for (_, (file, _, _)), n in self.origins.items() if path_part in file)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _synchronizes(func, args, kwargs):
            self.record(func.overloadpacket.__name__)
        return func(*args, **kwargs)

    def __enter__(self) -> SyncCounter:
        self._saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}
        for name, counts in _HOST_READS.items():
            setattr(torch.Tensor, name, self._counting(name, self._saved[name], counts))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        super().__exit__(*exc)

    def _counting(self, name: str, method: Callable[..., Any], counts: Callable[..., bool]) -> Callable[..., Any]:
        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self._inside:  # `__array__` calls `numpy`: one read
                return method(tensor, *args, **kwargs)
            if counts(tensor, *args, **kwargs):
                self.record(name)
            self._inside = True
            try:
                return method(tensor, *args, **kwargs)
            finally:
                self._inside = False

        wrapper.__name__ = name
        return wrapper


def _synchronizes(func: Any, args: Any, kwargs: Any) -> bool:
    if func in SYNC_OPS:
        return True
    if func is _aten.repeat_interleave.Tensor:  # the output's length is the repeats' sum, unless given
        return kwargs.get("output_size") is None
    if func in _BOOL_INDEX_OPS:  # a boolean mask selects as many rows as it has True values
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    return False


def _to_host_blocking(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
    """``Tensor.to`` that lands in host memory and waits for it (``non_blocking`` not set)."""
    device, _, non_blocking, _ = _compat.parse_to(*args, **kwargs)
    return device is not None and torch.device(device).type == "cpu" and not non_blocking


def _always(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
    return True


# The reads into host memory that dispatch no op on a CPU tensor, and when each call counts.
_HOST_READS: dict[str, Callable[..., bool]] = {
    "tolist": _always,
    "cpu": _always,
    "numpy": _always,
    "__array__": _always,
    "to": _to_host_blocking,
}
