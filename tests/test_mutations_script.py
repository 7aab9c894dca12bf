"""``scripts/mutations.py`` stays runnable as the code moves: each mutation's snippet occurs exactly once in its
file, and each test it names exists (a refactor that moved either would make the audit fail to apply, or run
nothing)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _mutations():
    spec = importlib.util.spec_from_file_location("scripts_mutations", REPO / "scripts" / "mutations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module.MUTATIONS


@pytest.mark.parametrize("mutation", _mutations(), ids=lambda m: m.name)
def test_each_mutation_applies_once_and_names_tests_that_exist(mutation):
    source = (REPO / mutation.path).read_text()
    assert source.count(mutation.old) == 1, f"{mutation.name}: its snippet is not in {mutation.path} exactly once"
    assert mutation.tests
    for test in mutation.tests:
        path, _, rest = test.partition("::")
        name = rest.split("[")[0].split("::")[-1]
        assert (REPO / path).is_file(), test
        assert not name or f"def {name}(" in (REPO / path).read_text(), f"{mutation.name}: no test {test}"
