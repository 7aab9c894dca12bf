"""docs/architecture.md against the code: every module it names exists, and each "A → B" it draws is an import of
A's (directly or through other lightning_rec modules)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_rec"
DOC = REPO / "docs" / "architecture.md"


def _module_file(dotted: str) -> Path | None:
    path = REPO / Path(*dotted.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imports(file: Path) -> set[Path]:
    """The lightning_rec modules ``file`` imports (``from lightning_rec.x import y`` counts ``x`` and ``x.y``)."""
    out = set()
    for node in ast.walk(ast.parse(file.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith("lightning_rec"):
                found = _module_file(name)
                if found is not None:
                    out.add(found)
    return out


def _reachable(start: Path) -> set[Path]:
    seen, todo = set(), [start]
    while todo:
        file = todo.pop()
        for dep in _imports(file) - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def _resolve(name: str, base: Path) -> Path:
    for root in (base, PACKAGE):
        candidate = root / name
        if candidate.exists():
            return candidate
    raise AssertionError(f"docs/architecture.md names {name!r}, which is not in lightning_rec/")


def test_every_module_the_architecture_doc_names_exists():
    text = DOC.read_text()
    names = set(re.findall(r"\b((?:[a-z_]+/)*[a-z_]+\.py|[a-z_]+/)(?=[`\s,)]|$)", text, flags=re.M))
    names = {n for n in names if not n.startswith(("tests/", "docs/", "examples/", "benchmarks/"))}
    assert len(names) > 15
    for name in names:
        if name.startswith("test_"):
            continue
        name = name.removeprefix("lightning_rec/")
        assert (PACKAGE / name).exists() or any(PACKAGE.glob(f"*/{name}")), name


def test_each_arrow_in_the_architecture_doc_is_an_import():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("|") and "→" in line]
    assert rows
    checked = 0
    for row in rows:
        where = row.rstrip("|").rsplit("|", 1)[-1]
        source_name, _, rest = where.partition("→")
        source = _resolve(re.findall(r"`([^`]+)`", source_name)[0], PACKAGE)
        reached = _reachable(source)
        base = source.parent
        for group in re.finditer(r"`([^`]+)`(?:\s*\(→([^)]*)\))?", rest):
            target = _resolve(group.group(1), base)
            assert target in reached, f"{source.relative_to(REPO)} does not import {target.relative_to(REPO)}"
            checked += 1
            for inner in re.findall(r"`([^`]+)`", group.group(2) or ""):
                nested = _resolve(inner, target.parent)
                assert nested in _reachable(target), (
                    f"{target.relative_to(REPO)} does not import {nested.relative_to(REPO)}"
                )
                checked += 1
    assert (
        checked >= 7
    )  # the setup row: recshard -> settings, sharder (-> sharding, dmp, unsharded, cpu_lookup), tables
