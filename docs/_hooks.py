"""MkDocs hook: the package's docstrings are Google style with Sphinx's inline roles, as TorchRec's and Lightning's
are (``:class:`~lightning_rec.RecShardStrategy```, ``Example::``). mkdocstrings renders a docstring as Markdown, where
a role stays as text; this shows its target as code, as Sphinx would (a leading ``~`` keeps the last name only), and
``Example::`` as a label. The docstrings themselves stay as they are (the doctests and ``help()`` read them)."""

from __future__ import annotations

import re
from typing import Any

# The leading colon may be gone: a "Returns: an :class:`X`" line loses it to the "type: description" split.
_ROLE = re.compile(r"(?<![\w-]):?(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj):<code>(~?)([^<]*)</code>")
_LITERAL_LABEL = re.compile(r"<p>(\w[\w ]*)::</p>")


def _target(match: re.Match[str]) -> str:
    short, name = match.group(1), match.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if short else name}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    html = _ROLE.sub(_target, html)
    return _LITERAL_LABEL.sub(r"<p><strong>\1:</strong></p>", html)
