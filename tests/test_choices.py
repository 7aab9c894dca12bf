"""Every choice in the schema and the config is checked (issue 44): each enumerated (``Literal``-typed) field is found
by walking the types, not listed by hand, and a misspelled value of each accepted one is refused in one line that
names the value, every accepted value and the one meant. A field or class added later with a choice that is not
checked fails here; so does a new dataclass reachable from the schema that this test cannot build."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING
from pathlib import Path
from typing import Any, Literal

import pytest
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningDataModule, LightningModule

import lightning_rec.data
import lightning_rec.models
from lightning_rec import RecShardStrategy
from lightning_rec._choices import choices_of
from lightning_rec._cli_errors import one_line
from lightning_rec.data import DenseColumn, LabelColumn, Schema, SparseColumn, TabularDataModule

# The smallest valid column of each kind the schema holds: a new kind of column (a dataclass the schema reaches) must
# be added here, or `test_every_dataclass_the_schema_reaches_can_be_built_here` fails.
MINIMAL: dict[type, dict[str, Any]] = {
    LabelColumn: {"column": "clicked"},
    DenseColumn: {"column": "price"},
    SparseColumn: {"column": "user_id", "num_embeddings": 10},
}


def _members(annotation: Any) -> Iterator[Any]:
    """The types an annotation is made of: its union members and container arguments, recursively."""
    yield annotation
    for arg in typing.get_args(annotation):
        if typing.get_origin(annotation) is not Literal:
            yield from _members(arg)


def _dataclasses_under(cls: type, seen: set[type] | None = None) -> set[type]:
    seen = set() if seen is None else seen
    for hint in typing.get_type_hints(cls).values():
        for t in _members(hint):
            if dataclasses.is_dataclass(t) and isinstance(t, type) and t not in seen:
                seen.add(t)
                _dataclasses_under(t, seen)
    return seen


def _misspelled(choice: str) -> str:
    return choice + choice[-1]  # "log1p" -> "log1pp", "hash" -> "hashh"


def _refused_in_one_line(message: str, value: str, choices: tuple[Any, ...], meant: Any) -> None:
    assert "\n" not in message, message
    assert repr(value) in message, message
    assert all(repr(c) in message or str(c) in message for c in choices), message
    assert f"did you mean {meant!r}?" in message, message


SCHEMA_CLASSES = sorted([Schema, *_dataclasses_under(Schema)], key=lambda c: c.__name__)
SCHEMA_FIELDS = [
    (cls, f.name, choice)
    for cls in SCHEMA_CLASSES
    for f in dataclasses.fields(cls)
    for choice in choices_of(typing.get_type_hints(cls)[f.name])
]


def test_the_walk_finds_the_schema_s_choices():
    """The walk itself can fail: the choices known today are among those it finds."""
    found = {(cls.__name__, name) for cls, name, _ in SCHEMA_FIELDS}
    assert {("SparseColumn", "ids"), ("DenseColumn", "transform")} <= found


def test_every_dataclass_the_schema_reaches_can_be_built_here():
    assert set(SCHEMA_CLASSES) - {Schema} == set(MINIMAL), "add the new column kind to MINIMAL"


def _schema_with(cls: type, column: dict[str, Any]) -> dict[str, Any]:
    """A schema dict holding ``column`` (of kind ``cls``) in the Schema field that holds that kind."""
    schema: dict[str, Any] = {"labels": [MINIMAL[LabelColumn]]}
    hints = typing.get_type_hints(Schema)
    [where] = [f.name for f in dataclasses.fields(Schema) if cls in set(_members(hints[f.name]))]
    schema[where] = [column]
    return schema


@pytest.mark.parametrize("cls, name, choice", SCHEMA_FIELDS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_misspelled_schema_choice_is_refused_in_one_line(cls: type, name: str, choice: str) -> None:
    Schema(**_schema_with(cls, {**MINIMAL[cls], name: choice}))  # the value itself is accepted
    bad = _misspelled(choice)
    with pytest.raises(ValueError) as err:
        Schema(**_schema_with(cls, {**MINIMAL[cls], name: bad}))
    message = str(err.value)
    _refused_in_one_line(message, bad, choices_of(typing.get_type_hints(cls)[name]), choice)
    assert f" {name} " in message and MINIMAL[cls]["column"] in message, message  # the field and the column


# ---- TabularDataModule's own arguments --------------------------------------------------------------------------
def _slots(annotation: Any) -> Iterator[tuple[Callable[[str], Any], tuple[Any, ...]]]:
    """Where a choice sits in an argument's type: the argument itself, or a dict's values (``{column: choice}``)."""
    direct = choices_of(annotation)
    if direct:
        yield (lambda v: v), direct
    for member in _members(annotation):
        if typing.get_origin(member) in (dict, Mapping) and choices_of(typing.get_args(member)[1]):
            yield (lambda v: {"price": v}), choices_of(typing.get_args(member)[1])
            return


TABULAR_ARGS = [
    (name, wrap, choice)
    for name, hint in typing.get_type_hints(TabularDataModule.__init__).items()
    for wrap, choices in _slots(hint)
    for choice in choices
]


@pytest.mark.parametrize("name, wrap, choice", TABULAR_ARGS, ids=lambda x: x if isinstance(x, str) else "")
def test_a_misspelled_datamodule_choice_is_refused_in_one_line(name: str, wrap: Callable, choice: str) -> None:
    schema = {"labels": [{"column": "clicked"}], "dense": [{"column": "price"}]}
    TabularDataModule(schema=schema, train=["clicks.csv"], **{name: wrap(choice)})  # files are read by check()
    bad = _misspelled(choice)
    with pytest.raises(ValueError) as err:
        TabularDataModule(schema=schema, train=["clicks.csv"], **{name: wrap(bad)})
    message = str(err.value)
    assert "\n" not in message and repr(bad) in message and f"did you mean {choice!r}?" in message, message
    assert name in message, message


def test_the_walk_finds_the_datamodule_s_choices():
    assert {"bad_rows", "fill"} <= {name for name, _, _ in TABULAR_ARGS}
    assert len([a for a in TABULAR_ARGS if a[0] == "fill"]) == 2  # fill: "mean", and {column: "mean"}


# ---- the config: every shipped model, DataModule and the strategy, as the CLI parses and builds them ---------------
def _shipped() -> list[type]:
    models = [getattr(lightning_rec.models, n) for n in lightning_rec.models.__all__]
    data = [getattr(lightning_rec.data, n) for n in lightning_rec.data.__all__]
    classes = [
        c for c in models + data if isinstance(c, type) and issubclass(c, (LightningModule, LightningDataModule))
    ]
    return [*classes, RecShardStrategy]


def _config_choices() -> list[tuple[str, Any, Any]]:
    """(``Class.argument``, its annotation, one accepted value) for every argument whose type enumerates values."""
    out = []
    for cls in _shipped():
        for name, hint in typing.get_type_hints(cls.__init__).items():
            out += [(f"{cls.__name__}.{name}", hint, c) for c in choices_of(hint)]
    return out


def _config_dataclass_choices() -> list[tuple[str, type, str, Any]]:
    """(``Class.argument``, a dataclass the argument takes, its enumerated field, one accepted value)."""
    out = []
    for cls in _shipped():
        for name, hint in typing.get_type_hints(cls.__init__).items():
            for t in {m for m in _members(hint) if dataclasses.is_dataclass(m) and isinstance(m, type)}:
                for f, field_hint in typing.get_type_hints(t).items():
                    out += [(f"{cls.__name__}.{name}", t, f, c) for c in choices_of(field_hint)]
    return out


CONFIG_CHOICES = _config_choices()
REQUIRED = {"str": "t", "int": 10}  # a value for a config dataclass's fields without a default, by annotation
CONFIG_DATACLASS_CHOICES = _config_dataclass_choices()


def test_the_walk_finds_the_config_s_choices():
    arguments = {a for a, _, _ in CONFIG_CHOICES}
    assert {"DLRMModule.interaction", "DLRMModule.dense_optimizer", "RecShardStrategy.bounds_check"} <= arguments
    assert {"TabularDataModule.bad_rows", "RecShardStrategy.nonfinite"} <= arguments
    fields = {(t.__name__, f) for _, t, f, _ in CONFIG_DATACLASS_CHOICES}
    assert {("EmbeddingOptimizer", "name"), ("QuantizedComms", "forward")} <= fields


@pytest.mark.parametrize("argument, hint, choice", CONFIG_CHOICES, ids=lambda x: x if isinstance(x, str) else "")
def test_a_misspelled_config_choice_is_one_line_from_the_cli_s_parser(argument: str, hint: Any, choice: Any) -> None:
    """The value as the CLI's parser (jsonargparse, under Lightning's CLI) checks it, told as the CLI tells it."""
    if not isinstance(choice, str):
        pytest.skip("only text choices can be misspelled")
    key = argument.split(".")[1]
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument(f"--{key}", type=hint)
    assert getattr(parser.parse_args([f"--{key}={choice}"]), key) == choice
    bad = _misspelled(choice)
    with pytest.raises(Exception) as err:
        parser.parse_args([f"--{key}={bad}"])
    line = one_line(str(err.value))
    _refused_in_one_line(line, bad, choices_of(hint), choice)
    assert line.startswith(f"{key}: "), line


@pytest.mark.parametrize(
    "argument, cls, name, choice", CONFIG_DATACLASS_CHOICES, ids=lambda x: getattr(x, "__name__", str(x))
)
def test_a_misspelled_choice_in_a_config_dataclass_is_refused_in_one_line(
    argument: str, cls: type, name: str, choice: Any
) -> None:
    """A config dataclass given as a mapping in YAML (``embedding_optimizer: {name: ...}``) is built by its class."""
    required = {f.name: REQUIRED[f.type] for f in dataclasses.fields(cls) if f.default is f.default_factory is MISSING}
    cls(**required, **{name: choice})
    bad = _misspelled(choice)
    with pytest.raises(ValueError) as err:
        cls(**required, **{name: bad})
    _refused_in_one_line(str(err.value), bad, choices_of(typing.get_type_hints(cls)[name]), choice)


def test_choices_of_reads_unions_and_not_containers():
    assert choices_of(Literal["a"] | None) == ("a",)
    assert choices_of(types.UnionType | dict[str, Literal["a"]]) == ()
    assert json.dumps(choices_of(float | Literal["mean"])) == '["mean"]'


def test_a_misspelled_transform_is_one_line_and_exit_2_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case through ``lightning-rec fit``: ``transform: log1pp`` trained with no transform; now it is
    refused before the Trainer's fit (so before any rank starts)."""
    import lightning.pytorch as pl
    import yaml

    from lightning_rec._cli import run

    monkeypatch.setattr(pl.Trainer, "fit", lambda *a, **k: pytest.fail("Trainer.fit ran"))
    (tmp_path / "clicks.csv").write_text("clicked,price,user_id\n1,2.5,7\n0,1.0,8\n")
    schema = {
        "labels": [{"column": "clicked"}],
        "dense": [{"column": "price", "transform": "log1pp"}],
        "sparse": [{"column": "user_id", "ids": "hash", "num_embeddings": 10}],
    }
    config = {
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "recshard", "logger": False},
        "model": {"class_path": "lightning_rec.models.DLRMModule"},
        "data": {
            "class_path": "lightning_rec.data.TabularDataModule",
            "init_args": {"schema": schema, "train": [str(tmp_path / "clicks.csv")]},
        },
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_:
        run(["fit", "--config", str(tmp_path / "c.yaml")])
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.split(" fit: error: ", 1)[1] == (
        "Schema: dense column 'price': transform 'log1pp' is not one of 'none', 'log1p', 'standardize'; did you mean "
        "'log1p'?"
    )
