"""The public/private line, checked on the source.

Public: ``lightning_rec`` (the top level), ``.data``, ``.integrations``, ``.models``, ``.serving``, ``.testing``,
``.metrics``, ``.callbacks``, ``.config``, ``.errors`` and ``.checkpoint`` (its load/export functions). Everything
else is private by its name: a module or package whose name starts with an underscore (``_strategy/``, ``_inputs/``,
``_cli.py``, ``checkpoint/_layout.py``, ...). Public modules say what they export (``__all__``); the package imports
every name from the module that defines it (no aliases, no re-export hops); and what users read and copy (the
examples, the benchmarks, the shipped configs, the README and the docs site's pages) imports public modules only.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
import yaml

import lightning_rec
from tests.helpers.source import imports as _imports

PACKAGE = Path(lightning_rec.__file__).parent
REPO = PACKAGE.parent
PUBLIC_MODULES = {
    "lightning_rec",
    "lightning_rec.callbacks",
    "lightning_rec.checkpoint",
    "lightning_rec.config",
    "lightning_rec.errors",
    "lightning_rec.metrics",
    "lightning_rec.progressive",
    "lightning_rec.publish",
}
# Packages whose modules are public unless their own name is private.
PUBLIC_PACKAGES = (
    "lightning_rec.data",
    "lightning_rec.integrations",
    "lightning_rec.models",
    "lightning_rec.retrieval",
    "lightning_rec.serving",
    "lightning_rec.testing",
)


def _all_modules() -> list[str]:
    names = ["lightning_rec"]
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="lightning_rec."):
        names.append(info.name)
    return sorted(names)


def _is_private(name: str) -> bool:
    return any(part.startswith("_") and part not in ("__init__", "__main__") for part in name.split("."))


def _is_public(name: str) -> bool:
    if _is_private(name):
        return False
    return name in PUBLIC_MODULES or any(name == p or name.startswith(p + ".") for p in PUBLIC_PACKAGES)


def _public_modules() -> list[str]:
    return [name for name in _all_modules() if _is_public(name) and not name.endswith(".__main__")]


def test_every_module_is_public_by_the_list_or_private_by_its_name():
    """A new module is either under a public package/in the list, or starts with an underscore: never in between."""
    neither = [n for n in _all_modules() if not _is_private(n) and not _is_public(n) and n != "lightning_rec.__main__"]
    assert not neither, f"neither public nor private by name: {neither}"
    # The list is real: each public module exists, and the strategy's machinery is private.
    modules = set(_all_modules())
    assert PUBLIC_MODULES <= modules and set(PUBLIC_PACKAGES) <= modules
    assert {"lightning_rec._strategy.recshard", "lightning_rec._inputs.checks", "lightning_rec._cli"} <= modules


@pytest.mark.parametrize("name", _public_modules())
def test_public_modules_declare_what_they_export(name):
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"
    assert not [n for n in exported if n.startswith("_")], f"{name}.__all__ exports a private name"
    if not hasattr(module, "__path__"):  # a plain module exports what it defines (packages gather their modules')
        foreign = [
            n
            for n in exported
            if inspect.isclass(getattr(module, n)) or inspect.isfunction(getattr(module, n))
            if getattr(getattr(module, n), "__module__", name) != name
        ]
        assert not foreign, f"{name}.__all__ re-exports {foreign}: import them from where they are defined"


@functools.cache  # every import of a module asks again
def _defined_at_top(module_name: str) -> set[str] | None:
    """Names a module binds itself (defs, classes, assignments), not those it imports; None for packages."""
    module = importlib.import_module(module_name)
    if hasattr(module, "__path__") or module.__file__ is None:
        return None
    tree = ast.parse(Path(module.__file__).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def test_the_package_imports_every_name_from_the_module_that_defines_it():
    """``from lightning_rec.x import name`` inside the package: ``name`` is a submodule of ``x`` or defined in ``x``,
    never a name ``x`` itself imported from elsewhere (aliases and re-export hops blur where things live)."""
    hops = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, module, names in _imports(path):
            if not module.startswith("lightning_rec"):
                continue
            defined = _defined_at_top(module)
            for n in names:
                where = f"{path.relative_to(REPO)}:{line} imports {n} from {module}"
                if defined is None:  # a package: its submodules, never the names it gathers for users
                    if importlib.util.find_spec(f"{module}.{n}") is None:
                        hops.append(f"{where}, a package: import it from its module")
                elif n not in defined:
                    hops.append(f"{where}, which does not define it")
    assert not hops, "\n".join(hops)


def _private_imports_in(path: Path) -> list[str]:
    found = []
    for line, module, names in _imports(path):
        if module.split(".")[0] != "lightning_rec":
            continue
        if _is_private(module) or (module == "lightning_rec" and any(n.startswith("_") for n in names)):
            found.append(f"{path.relative_to(REPO)}:{line} imports {module} {names}")
    return found


def test_examples_and_benchmarks_import_only_public_modules():
    files = sorted((REPO / "examples").rglob("*.py")) + sorted((REPO / "benchmarks").rglob("*.py"))
    assert len(files) > 10
    found = [f for path in files for f in _private_imports_in(path)]
    assert not found, "\n".join(found)


def _class_paths(node) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "class_path" and isinstance(v, str)] + [
            p for v in node.values() for p in _class_paths(v)
        ]
    if isinstance(node, list):
        return [p for v in node for p in _class_paths(v)]
    return []


def test_the_shipped_configs_name_only_public_classes():
    """What the CLI imports from a config (``class_path``) is public: a config is what a user copies."""
    configs = sorted((REPO / "examples" / "configs").glob("*.yaml"))
    assert configs
    found = []
    for config in configs:
        for path in _class_paths(yaml.safe_load(config.read_text())):
            if path.startswith("lightning_rec") and _is_private(path):
                found.append(f"{config.name}: {path}")
            elif path.startswith("lightning_rec"):
                module, _, name = path.rpartition(".")
                assert hasattr(importlib.import_module(module), name), path
    assert not found, "\n".join(found)


# lightning_rec.json and lightning_rec.sha256 are files inside an artifact, not modules
_FILE_SUFFIXES = ("json", "sha256", "py", "ckpt", "pt")


def _dotted_names(text: str) -> set[str]:
    """The dotted ``lightning_rec...`` names in ``text``, less versioned document names (``lightning_rec.x/1``)."""
    return {m.group(0) for m in re.finditer(r"lightning_rec(?:\.\w+)+(?!\w|/)", text)}


def _resolves(name: str) -> bool:
    """``name`` is a module, or an attribute path on one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if attr in _FILE_SUFFIXES:
                return True
            obj = getattr(obj, attr, None)
            if obj is None:
                return False
        return True
    return False


def _doc_pages() -> list[Path]:
    """The docs site's pages (docs/, the benchmarks included), less the package index's long description."""
    return sorted(p for p in (REPO / "docs").rglob("*.md") if p.name != "pypi.md")


def test_the_readme_names_only_public_modules():
    """Every dotted ``lightning_rec...`` name in the README and the docs site's pages (imports, ``python -m``, class
    paths, prose) is public and resolves; file paths (``lightning_rec/_strategy/...``) point a reader at the source and
    may be private."""
    readme = _dotted_names((REPO / "README.md").read_text())
    assert readme
    dotted = {
        (path.relative_to(REPO), d)
        for path in [REPO / "README.md", *_doc_pages()]
        for d in _dotted_names(path.read_text())
    }
    private = sorted(f"{path}: {d}" for path, d in dotted if _is_private(d))
    assert not private, f"the README or the docs name private modules: {private}"
    unresolved = sorted(f"{path}: {d}" for path, d in dotted if not _resolves(d))
    assert not unresolved, f"the README or the docs name what does not exist: {unresolved}"


def test_the_names_docstrings_and_docs_point_to_exist():
    """A docstring's or a doc's ``lightning_rec.x.Y`` names a module or attribute that exists, private or not (a
    reference left behind by a move is a dead end for the reader)."""
    files = [*sorted(PACKAGE.rglob("*.py")), REPO / "BENCHMARKS.md", *sorted((REPO / "docs").rglob("*.md"))]
    unresolved = sorted(
        f"{path.relative_to(REPO)}: {name}"
        for path in files
        for name in _dotted_names(path.read_text())
        if not _resolves(name)
    )
    assert not unresolved, "\n".join(unresolved)


def test_the_console_script_and_python_m_run_the_same_cli():
    """``lightning-rec`` and ``python -m lightning_rec`` are the one CLI; it lists every subcommand."""
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["lightning-rec"].partition(":")
    main = getattr(importlib.import_module(module), function)
    assert importlib.import_module("lightning_rec.__main__").main is main


def test_benchmarks_and_examples_do_not_put_the_repository_on_the_path():
    """They run on the installed package (issue 37: a benchmark inserted the repository into ``sys.path``)."""
    offenders = [
        str(path.relative_to(REPO))
        for folder in ("benchmarks", "examples")
        for path in (REPO / folder).rglob("*.py")
        if "sys.path.insert" in path.read_text() or "sys.path.append" in path.read_text()
    ]
    assert not offenders, offenders
