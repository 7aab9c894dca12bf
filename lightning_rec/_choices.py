"""Enumerated choices: the values a ``Literal``-typed field or argument accepts, read from its type (so a choice added
to a type is checked without another line), and a value outside them refused in one line naming the field, the value,
every accepted value and the nearest one.

Example::

    >>> from dataclasses import dataclass
    >>> from typing import Literal
    >>> @dataclass
    ... class Column:
    ...     transform: Literal["none", "log1p", "standardize"] = "none"
    >>> check_choices(Column("log1pp"), "dense column 'price'")
    Traceback (most recent call last):
    ...
    ValueError: dense column 'price': transform 'log1pp' is not one of 'none', 'log1p', 'standardize'; did you mean 'log1p'?
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal

__all__ = ["check_arguments", "check_choice", "check_choices", "choices_of", "did_you_mean"]


def choices_of(annotation: Any) -> tuple[Any, ...]:
    """The ``Literal`` values of a type, its own or its union members' (``float | Literal["mean"]``: ``("mean",)``);
    not those inside containers (``dict[str, Literal[...]]``: ``()``).

    Example::

        >>> choices_of(Literal["a", "b"] | None), choices_of(float | Literal["mean"]), choices_of(int)
        (('a', 'b'), ('mean',), ())
    """
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(v for member in typing.get_args(annotation) for v in choices_of(member))
    return ()


def _other_kinds(annotation: Any) -> tuple[type, ...]:
    """The plain classes a union admits beside its ``Literal`` members (``float | Literal["mean"]``: ``(float,)``)."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return ()
    out: list[type] = []
    for member in typing.get_args(annotation):
        origin = typing.get_origin(member)
        if origin is Literal or origin in (typing.Union, types.UnionType):
            continue
        out.append(origin or member)  # dict[str, float] -> dict
    return tuple(t for t in out if isinstance(t, type))


def did_you_mean(word: Any, candidates: Iterable[Any]) -> str:
    """``"; did you mean 'x'?"`` for the candidate nearest to ``word`` (difflib), or ``""`` when none is near.

    Example::

        >>> did_you_mean("standardise", ["none", "log1p", "standardize"])
        "; did you mean 'standardize'?"
    """
    names = {str(c): c for c in candidates}
    close = difflib.get_close_matches(str(word), list(names), n=1, cutoff=0.6)
    return f"; did you mean {names[close[0]]!r}?" if close else ""


def check_choice(where: str, name: str, value: Any, annotation: Any) -> None:
    """Refuse ``value`` for ``name`` (typed ``annotation``) when the type enumerates its values and ``value`` is
    neither one of them nor of another kind the type admits (a number for ``float | Literal["mean"]``).

    Raises:
        ValueError: ``"<where>: <name> <value> is not one of <choices>; did you mean <nearest>?"``, one line.
    """
    choices = choices_of(annotation)
    if not choices or value in choices:
        return
    others = _other_kinds(annotation)
    if others and isinstance(value, others) and not (isinstance(value, bool) and bool not in others):
        return
    accepted = ", ".join(repr(c) for c in choices)
    if others:
        accepted += f" (or a {' or a '.join(t.__name__ for t in others)})"
    raise ValueError(f"{where}: {name} {value!r} is not one of {accepted}{did_you_mean(value, choices)}")


def check_choices(obj: Any, where: str) -> None:
    """Every ``Literal``-typed field of the dataclass ``obj`` (see :func:`check_choice`), read from its type hints: a
    field added later is checked too.

    Raises:
        ValueError: naming ``where``, the field, the value, the accepted values and the nearest one.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        check_choice(where, f.name, getattr(obj, f.name), hints[f.name])


def check_arguments(function: Any, where: str, arguments: dict[str, Any]) -> None:
    """Every ``Literal``-typed parameter of ``function`` among ``arguments`` (e.g. an ``__init__``'s ``locals()``),
    read from its type hints: a parameter added later is checked too.

    Raises:
        ValueError: naming ``where``, the parameter, the value, the accepted values and the nearest one.
    """
    hints = typing.get_type_hints(function)
    for name, value in arguments.items():
        if name in hints and name != "return":
            check_choice(where, name, value, hints[name])
