"""The benchmark pages' commands (``docs/benchmarks/``, which BENCHMARKS.md indexes by question) name scripts that
exist, with options those scripts take (no script is run)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {"-m lightning_rec.testing.bench": REPO / "lightning_rec" / "testing" / "bench" / "runner.py"}


PAGES = REPO / "docs" / "benchmarks"


def test_benchmarks_md_indexes_every_benchmark_page():
    """BENCHMARKS.md (performance claims live there, by the house rule) links every page that holds the figures."""
    index = (REPO / "BENCHMARKS.md").read_text()
    pages = sorted(p.relative_to(REPO).as_posix() for p in PAGES.rglob("*.md") if p.name != "index.md")
    assert len(pages) >= 8
    assert not [p for p in pages if f"]({p})" not in index], pages


def _commands():
    text = "\n".join(p.read_text() for p in sorted(PAGES.rglob("*.md")))
    for block in re.findall(r"```(?:bash)?\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].strip()
            if ".venv/bin/python" in line and "/tmp/" not in line:  # (/tmp: an old tree exported on purpose)
                yield line[line.index(".venv/bin/python") :]


def _options(script: Path):
    return set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", script.read_text()))


def test_every_benchmarks_command_names_a_script_and_options_it_takes():
    checked = 0
    for command in _commands():
        words = shlex.split(command)[1:]
        if words[:2] == ["-m", "pytest"] or words[0] == "-c":
            continue
        if words[0] == "-m":
            script, args = SCRIPTS.get(f"-m {words[1]}"), words[2:]
            assert script is not None, command
        else:
            script, args = REPO / words[0], words[1:]
        assert script.exists(), command
        unknown = {a.split("=")[0] for a in args if a.startswith("--")} - _options(script)
        assert not unknown, (command, unknown)
        checked += 1
    assert checked >= 30
