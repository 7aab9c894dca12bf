"""Count device-to-host synchronisations.

On a GPU every op whose result the host must read (an ``.item()``, a ``bool()`` of a tensor, a data-dependent
shape like ``nonzero``) makes the host wait for the device, so every microsecond of Python after it lands on the
device's timeline. On CPU the same ops cost nothing, which hides them: :class:`SyncCounter` counts them on any
device, so a CPU test can guard a GPU property.

What it cannot tell on CPU is host memory from device memory: it counts every read through torch. lightning_rec reads
the batches it checks *before* they are copied to the device through numpy (no torch op), so a CPU count shows what
a GPU run would wait for; code that reads a host tensor through torch is counted as if it were on the device.
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional, Tuple

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
    }
)
_THIS_FILE = str(Path(__file__).resolve())
# torch's own plumbing between an op and the mode (dynamo's disable wrapper, the dispatch-mode helpers).
_PLUMBING = ("torch/_dynamo/", "torch/_compile.py", "torch/utils/_python_dispatch.py")


def _origin() -> Tuple[str, int, str]:
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

    ``Tensor.tolist`` dispatches no op, so it is counted by wrapping the method while the counter is entered. The
    origin of a sync is the innermost Python frame that asked for it (for an op inside torch's own Python code, that
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
        self._tolist: Optional[Callable[..., Any]] = None

    def record(self, op: str) -> None:
        if self.active:
            self.count += 1
            self.origins[(op, _origin())] += 1

    def count_from(self, path_part: str) -> int:
        """How many counted syncs were asked for by a frame whose file path contains ``path_part``."""
        return sum(n for (_, (file, _, _)), n in self.origins.items() if path_part in file)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in SYNC_OPS:
            self.record(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> "SyncCounter":
        original = self._tolist = torch.Tensor.tolist

        def tolist(tensor: torch.Tensor) -> Any:
            self.record("tolist")
            return original(tensor)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)
