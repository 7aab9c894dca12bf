"""The LightningModule class a checkpoint names, imported only from code already installed, never from the
checkpoint.

A checkpoint records the class it was saved from (the ``module_class`` record in ``meta.pt``,
``"package.module.Class"``), so that ``lightning-rec export`` can rebuild the module without being told. Whoever
wrote the checkpoint wrote that name, and importing a module runs its code: a checkpoint folder that carries a
``payload.py`` and names ``vendorckpt.payload.Model`` must not get it run by an export started beside it. So a name
taken from a checkpoint is imported only when every module on its way (``vendorckpt``, ``vendorckpt.payload``) is
already imported, or is found, without running anything, on ``sys.path`` as it stands (nothing is added for it)
and outside the checkpoint: not in its folder, not directly beside it. Python's standard library holds no
LightningModule, so a name from it (``subprocess.Popen``, ``os.system``) is refused without importing anything; and
whatever is imported must be a LightningModule class. A class the user names (``model_class=``,
``--model-class``) is imported as named: that is the user's own code.

Example::

    cls = named_class("lightning_rec.models.DLRMModule", Path("last.ckpt"), named_by_user=False)
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_rec.errors import CheckpointError

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
HINT = "HINT: name the class yourself: `--model-class package.module.Class` (`model_class=` in Python)."


def named_class(name: str | type, checkpoint: Path, *, named_by_user: bool) -> type[pl.LightningModule]:
    """The LightningModule class ``name`` (``"package.module.Class"``, or the class itself).

    Args:
        name: the class, or its dotted name.
        checkpoint: the checkpoint directory it is for (named in messages; where a name it recorded may not lead).
        named_by_user: whether the user named the class (imported as named) or the checkpoint did (imported only
            from outside the checkpoint, see the module's docstring).

    Raises:
        CheckpointError: in one line, saying why the class is not imported and how to name it.
    """
    if isinstance(name, type):
        cls: Any = name
    else:
        if not isinstance(name, str) or not _DOTTED.fullmatch(name):
            raise _refused(name, checkpoint, "which is not a dotted class name", named_by_user)
        module_name, _, attribute = name.rpartition(".")
        if not named_by_user:
            why = _untrusted_source(module_name, checkpoint)
            if why:
                raise _refused(name, checkpoint, why, named_by_user)
        try:
            cls = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError, ValueError) as err:
            raise _not_importable(name, module_name, attribute, err, checkpoint, named_by_user) from None
    if not (isinstance(cls, type) and issubclass(cls, pl.LightningModule)):
        what = f"a {type(cls).__name__}" if not isinstance(cls, type) else f"the class {cls.__name__}"
        raise _refused(name, checkpoint, f"which is {what}, not a LightningModule class", named_by_user)
    return cls


def _refused(name: Any, checkpoint: Path, why: str, named_by_user: bool) -> CheckpointError:
    if named_by_user:
        return CheckpointError(f"model_class {name!r} is refused, {why}. HINT: name a LightningModule class.")
    return CheckpointError(
        f"{str(checkpoint)!r} names {name!r} as the LightningModule it was saved from, {why}; it is not imported "
        f"(a checkpoint never runs code). {HINT}"
    )


def _not_importable(
    name: str, module_name: str, attribute: str, err: BaseException, checkpoint: Path, named_by_user: bool
) -> Exception:
    hint = HINT
    top = module_name.split(".")[0]
    if not named_by_user and importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is not None:
        # Trained from this folder (`python train.py` beside models.py): the working directory is not searched for a
        # class a checkpoint names, only for one the user names.
        hint = (
            f"HINT: {top} is in the working directory, which is not searched for a class a checkpoint names; if it "
            f"is your code, name it: `--model-class {name}` (`model_class=` in Python)."
        )
    if module_name == "__main__":  # saved by a script: its module name is only known to the user
        hint = (
            f"HINT: {attribute} was defined in the script that trained it; pass `model_class=` (`--model-class "
            f'script.{attribute}` from the script\'s folder, its training guarded by `if __name__ == "__main__":`).'
        )
    reason = f"{err}".splitlines()[0] if str(err) else type(err).__name__
    return CheckpointError(f"cannot import the model class {name!r} of {str(checkpoint)!r}: {reason}. {hint}")


def _untrusted_source(module_name: str, checkpoint: Path) -> str:
    """Why the module ``module_name`` a checkpoint named may not be imported ("": it may).

    Each package on the way is located as Python's import would find it (``importlib``'s finders; nothing of it
    runs), unless it is imported already (its code has run in this process anyway)."""
    top = module_name.split(".")[0]
    if top == "__main__":
        return ""  # the running program itself: nothing is imported
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return f"from Python's standard library ({top}), which holds no LightningModule"
    folder = os.path.realpath(checkpoint)
    beside = os.path.dirname(folder)
    parent_spec: Any = None
    parts = module_name.split(".")
    for i in range(len(parts)):
        fullname = ".".join(parts[: i + 1])
        if fullname in sys.modules:
            parent_spec = getattr(sys.modules[fullname], "__spec__", None)
            continue
        try:
            if parent_spec is None and i == 0:
                spec = importlib.util.find_spec(fullname)  # a top-level name: found, not imported
                # Not importable as things stand: where a shell's or `python -m`'s working directory would find it
                # (looked for only to say so; nothing is added to sys.path).
                spec = spec or importlib.machinery.PathFinder.find_spec(fullname, [os.getcwd(), beside, folder])
            elif parent_spec is not None and parent_spec.submodule_search_locations is not None:
                spec = importlib.machinery.PathFinder.find_spec(fullname, list(parent_spec.submodule_search_locations))
            else:
                return ""  # not a package: the import fails and says so
        except (ImportError, ValueError):
            return ""
        if spec is None:
            return ""  # the import fails and says so
        for location in _locations(spec):
            real = os.path.realpath(location)
            if real == folder or real.startswith(folder.rstrip(os.sep) + os.sep):
                return f"a module inside the checkpoint folder ({location})"
            if os.path.dirname(real) == beside:
                return f"a module beside the checkpoint folder ({location}), not one installed"
        parent_spec = spec
    return ""


def _locations(spec: Any) -> list[str]:
    """The files and folders a module's spec would import from."""
    found = [spec.origin] if spec.has_location and spec.origin else []
    return found + [str(p) for p in (spec.submodule_search_locations or [])]
