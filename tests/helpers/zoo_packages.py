"""Zoo models trained a few steps and exported as ``.pt2`` packages with fp32 tables, once per test session.

tests/test_serving_pt2.py and tests/test_serving_inputs.py both serve DeepFM (tests/test_serving.py's ``MODELS``
build: ten times the zoo's learning rates), SASRec and the two towers' query part from such packages. An AOTInductor
compile costs 10-80 s on 2 cores, so each (checkpoint, part, bounds check) is compiled once in a session and every
module that asks gets the same package and spec; each module loads its own module from the shared checkpoint.

The files are shared: callers read them and never rewrite them (a test that alters an artifact copies it first).

Example::

    ckpt = zoo_checkpoint(zoo_deepfm.CASE, MODELS["deepfm"][1], 4, tmp_path_factory)
    path, spec = zoo_package(ckpt, part=None)
    model = load_pt2(path)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lightning_rec.config import BoundsCheck
from lightning_rec.serving import InferenceSpec, export_inference
from tests.helpers.dist import in_this_process
from tests.helpers.zoo import ZooCase

_CHECKPOINTS: dict[tuple[int, int, int], Path] = {}
_PACKAGES: dict[tuple[Path, str | None, BoundsCheck], tuple[Path, InferenceSpec]] = {}


def zoo_checkpoint(
    case: ZooCase, build: Callable[[], Any] | None, steps: int, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """``(build or case.build)()`` trained ``steps`` steps on ``case``'s batches (one process), saved as a sharded
    checkpoint: once per session for each (case, build, steps)."""
    from tests.test_serving import trained_checkpoint  # the tests' one way of training a serving checkpoint

    key = (id(case), id(build), steps)
    if key not in _CHECKPOINTS:
        work = tmp_path_factory.mktemp("zoo_checkpoint")
        module = (build or case.build)()
        with in_this_process(work):  # a session-wide fit in pytest's process: give back its port and group
            _CHECKPOINTS[key] = trained_checkpoint(module, case.batches(steps), work / "ckpt")
    return _CHECKPOINTS[key]


def zoo_package(ckpt: Path, part: str | None, bounds_check: BoundsCheck = "error") -> tuple[Path, InferenceSpec]:
    """``ckpt`` exported with fp32 tables as a ``.pt2`` package (``part``: the two towers' ``"query"`` or
    ``"candidate"``), once per session for each (checkpoint, part, bounds check): the package's path and a copy of the
    spec :func:`~lightning_rec.serving.export_inference` returned."""
    key = (ckpt, part, bounds_check)
    if key not in _PACKAGES:
        path = ckpt.parent / f"{part or 'model'}_{bounds_check}.pt2"
        spec = export_inference(ckpt, path, table_dtype="fp32", part=part, bounds_check=bounds_check)
        _PACKAGES[key] = (path, spec)
    path, spec = _PACKAGES[key]
    return path, copy.deepcopy(spec)
