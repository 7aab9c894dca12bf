"""Modules that moved when the package took its layout (``strategy/``, ``inputs/``): the old import paths keep
working, with a ``DeprecationWarning`` naming the new one.

An import hook rather than a stub file per old module, so the package's tree shows only where things are. The old
name is an alias of the new module (the same object), so classes pickled under either path load, and
``isinstance`` checks agree.

Example::

    >>> import warnings
    >>> with warnings.catch_warnings(record=True):
    ...     warnings.simplefilter("always")
    ...     from lightning_rec.sharding import plan_module
    >>> plan_module.__module__
    'lightning_rec.strategy.sharding'
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "install"]

# old module path -> new module path
MOVED = {
    **{
        f"lightning_rec.{name}": f"lightning_rec.strategy.{name}"
        for name in ("dmp", "faults", "optim", "pipeline", "plan_report", "settings", "sharding", "unsharded")
    },
    "lightning_rec.kjt_check": "lightning_rec.inputs",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"`{spec.name}` moved to `{new}`; import it from there.", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The new module ran when it was imported."""


def install() -> None:
    """Put the hook on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
