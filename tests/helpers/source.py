"""Reading the repository's Python source as the layout tests do (``test_layout.py``, ``test_public_api.py``)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path


def imports(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """Every absolute import in the file at ``path``: ``(line, module, names)`` (``names`` empty for ``import m``).

    Example::

        >>> from pathlib import Path
        >>> next(m for _, m, _ in imports(Path(__file__)))
        '__future__'
    """
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
