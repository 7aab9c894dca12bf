"""Which submodules of a model hold embedding tables: a pure function of the module tree, below the machinery
that shards them (the sharding plan, the input checks and the unsharded view all ask it)."""

from __future__ import annotations

from typing import Dict, Sequence, Type

from torch import nn

__all__ = ["embedding_modules"]


def embedding_modules(module: nn.Module, module_types: Sequence[Type[nn.Module]]) -> Dict[str, nn.Module]:
    """The outermost submodules of ``module`` that a sharder can shard, by module path."""
    found: Dict[str, nn.Module] = {}
    types = tuple(module_types)

    def visit(mod: nn.Module, path: str) -> None:
        if isinstance(mod, types):
            found[path] = mod
            return
        for name, child in mod.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(module, "")
    return found
