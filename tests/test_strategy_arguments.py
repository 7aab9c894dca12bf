"""One declaration of each strategy option (issue 37): ``RecShardStrategy.__init__``'s signature is the source; its
docstring's ``Args`` and the reference table (``docs/strategy-arguments.md``) must name exactly the same options, so
an option added, renamed or removed in one place fails here until the others follow. (The CLI reads the signature
itself: jsonargparse builds ``--trainer.strategy.init_args.*`` from it.)"""

from __future__ import annotations

import inspect
import re

from lightning_rec import RecShardStrategy
from tests.helpers.data import REPO

# Lightning's plumbing, set by its accelerator connector, not by users (documented together in one docstring line).
LIGHTNING = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}


def _signature() -> set[str]:
    return {p for p in inspect.signature(RecShardStrategy.__init__).parameters if p != "self"} - LIGHTNING


def _docstring() -> set[str]:
    doc = inspect.getdoc(RecShardStrategy) or ""
    args = doc.split("Args:", 1)[1]
    args = re.split(r"\n(?:Example|Returns|Raises|Attributes)[^\n]*:\n", args)[0]
    names: set[str] = set()
    for line in args.splitlines():
        entry = re.match(r"^    (\w+(?:, \w+)*):", line)  # an entry names one option or several, comma-separated
        if entry:
            names.update(n.strip() for n in entry.group(1).split(","))
    return names - LIGHTNING


def _table() -> set[str]:
    text = (REPO / "docs" / "strategy-arguments.md").read_text()
    return {name for row in re.findall(r"^\| (`[^|]*`) \|", text, re.M) for name in re.findall(r"`(\w+)`", row)}


def test_the_docstring_and_the_reference_table_name_exactly_the_signatures_options():
    options = _signature()
    assert _docstring() == options, (sorted(options - _docstring()), sorted(_docstring() - options))
    assert _table() == options, (sorted(options - _table()), sorted(_table() - options))
