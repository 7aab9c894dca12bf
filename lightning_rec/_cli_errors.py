"""Config mistakes in one line: jsonargparse's 40-80-line report of a typo (the usage, every Union subtype tried, a
dump of the namespace) condensed to what is wrong, where, and what would be accepted, with a "did you mean".

Example::

    >>> one_line('Parser key "model":\\n  Does not validate against any of the Union subtypes\\n  Errors:\\n'
    ...          "    - Problem with given class_path 'lightning_rec.models.DeepFMModule':\\n"
    ...          "        Option 'embeding_dim' is not accepted\\n    - Expected a <class 'NoneType'>\\n"
    ...          "  Given value type: <class 'dict'>")  # doctest: +ELLIPSIS
    "model (lightning_rec.models.DeepFMModule): option 'embeding_dim' is not accepted; did you mean 'embedding_dim'? ..."
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Iterable

from lightning.pytorch.cli import LightningArgumentParser

from lightning_rec._choices import did_you_mean

__all__ = ["OneLineErrors", "one_line"]

_KEY = re.compile(r'Parser key "([^"]+)"')
_CLASS = re.compile(r"class_path '([\w.]+)'")
_OPTION = re.compile(r"Option '([^']+)' is not accepted")
_SUBCOMMAND_OPTION = re.compile(r"does not accept option '([^']+)'")
_CLASS_REPR = re.compile(r"<class '([\w.]+)'>")
_LITERAL = re.compile(r"Expected a typing\.Literal\[(.*)\]\.? Got value: (.*)")
_UNION_LITERAL = re.compile(r"Expected a typing\.Literal\[(.*)\]\s*$", re.MULTILINE)  # one of a Union's members
_GIVEN = re.compile(r"Given value: (.*)")
_NOISE = ("Given value", "Subtypes:", "Errors:", "Expected a <class 'NoneType'>", "Does not validate against any")


def one_line(message: str, known: Iterable[str] = ()) -> str:
    """jsonargparse's error ``message`` as one line; ``known``: the option names of the parser that raised it (for a
    "did you mean" on an unknown top-level option)."""
    option = _OPTION.search(message)
    cls = _CLASS.search(message)
    key = _KEY.search(message)
    if option and cls:
        accepted = _parameters(cls.group(1))
        where = f"{key.group(1)} ({cls.group(1)})" if key else cls.group(1)
        return f"{where}: option '{option.group(1)}' is not accepted{_did_you_mean(option.group(1), accepted)}" + (
            f" (it takes {', '.join(accepted)})" if accepted else ""
        )
    choice = _LITERAL.search(message)
    if choice:  # a value outside an enumerated type's values
        where = _where(message, choice.start(), cls.group(1) if cls else None)
        return f"{where}{_not_a_choice(choice.group(2).strip(), choice.group(1))}"
    member = _UNION_LITERAL.search(message)
    given = _GIVEN.search(message, member.end()) if member else None
    if member and given:  # the same, where the type is a Union (`float | Literal["mean"] | dict`)
        where = _where(message, member.start(), cls.group(1) if cls else None)
        return f"{where}{_not_a_choice(given.group(1).strip(), member.group(1), ' nor of another type it takes')}"
    unknown = _SUBCOMMAND_OPTION.search(message)
    if unknown:
        return message.strip().splitlines()[0] + _did_you_mean(unknown.group(1), known)
    lines = [line.strip(" -") for line in message.strip().splitlines()]
    kept = [line for line in lines if line and not line.startswith(_NOISE)]
    reasons = [line for line in kept if not line.startswith(("Parser key", "Problem with given class_path"))]
    if not reasons:
        return "; ".join(kept) or message.strip()
    keys = _KEY.findall(message)
    where = ".".join(keys) + (f" ({cls.group(1)})" if cls else "")
    reason = _CLASS_REPR.sub(r"\1", reasons[-1])
    return f"{where}: {reason}" if where else reason


def _where(message: str, end: int, class_path: str | None) -> str:
    """``"data.fill (lightning_rec.data.TabularDataModule): "``: the parser keys up to ``end``, and the class."""
    keys = ".".join(_KEY.findall(message[:end]))
    if not keys:
        return ""
    return f"{keys} ({class_path}): " if class_path else f"{keys}: "


def _not_a_choice(value: str, literal: str, also: str = "") -> str:
    """``"'dott' is not one of 'dot', 'dcn'; did you mean 'dot'?"`` from a ``typing.Literal``'s values as printed."""
    try:
        choices = list(ast.literal_eval(f"[{literal}]"))
    except (ValueError, SyntaxError):
        return f"{value!r} is not one of {literal}{also}"
    return f"{value!r} is not one of {', '.join(map(repr, choices))}{also}{did_you_mean(value, choices)}"


def _parameters(class_path: str) -> list[str]:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        params = inspect.signature(cls.__init__).parameters.values()
    except (ImportError, AttributeError, ValueError, TypeError):
        return []
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    return did_you_mean(word, candidates)


class OneLineErrors(LightningArgumentParser):
    """Lightning's CLI parser whose errors print one line (``<prog>: error: ...``) and exit 2, as ``lightning-rec
    export`` does; ``--help`` still shows every option."""

    def error(self, message: str, ex: Exception | None = None) -> None:  # type: ignore[override]
        if not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        known = [action.dest for action in getattr(parser, "_actions", [])]
        prog = parser.prog.replace(" [options]", "")
        self.exit(2, f"{prog}: error: {one_line(message, known)}\n")
