"""The docs site (``mkdocs.yml``, ``docs/``) and the README: the code and commands they show are what runs.

``.ci/run`` builds the site with ``mkdocs build --strict``, which fails on a broken link or anchor, a page missing from
the nav, a missing snippet file and a docstring mkdocstrings cannot read. What that build cannot see is checked here,
on the pages as the site shows them (the README sections they include expanded):

- every ```python block parses;
- every ``lightning-rec fit/validate/test/predict`` command with concrete arguments goes through the CLI's own parser
  with ``--print_config`` (nothing is built, read or trained): a config path that moved, a renamed or misspelt option,
  a value of the wrong type fails; ``plan``/``export``/``prepare`` use options their ``--help`` lists;
- every ``python SCRIPT``/``python -m MODULE``/``torchrun ... SCRIPT`` names a file or module that exists, with options
  the script takes; ``pytest`` commands name test files that exist;
- the files the guides point a reader to (``lightning_rec/...``, ``tests/...``, ``examples/...``) exist, so a moved
  module fails here until its page follows; the package layout page names modules that exist.

The README's own blocks are run elsewhere: the quickstart (``tests/test_readme.py``, ``tests/test_install.py``), the C++
example's commands (``tests/test_serving_cpp.py``), the main job (``tests/test_main_job.py``).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import re
import shlex
import textwrap
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PACKAGE = REPO / "lightning_rec"
# Configs a page names as the reader's own file, not one shipped here.
PLACEHOLDER_CONFIGS = {"my.yaml", "my_clicks.yaml"}
SCRIPTS = {"lightning_rec.testing.bench": PACKAGE / "testing" / "bench" / "runner.py"}
CLI_SUBCOMMANDS = {"fit", "validate", "test", "predict"}
OWN_SUBCOMMANDS = {"plan", "export", "prepare", "index"}
# Options of `lightning-rec plan` that it passes on to the config, as `fit` takes them.
CONFIG_OPTIONS = ("--config", "-c", "--data.", "--model.", "--trainer.", "--seed_everything")


def _snippet(target: str) -> str:
    """What pymdownx.snippets puts in place of ``--8<-- "FILE"`` or ``--8<-- "FILE:SECTION"`` (mkdocs.yml)."""
    file, _, section = target.partition(":")
    text = (REPO / file).read_text()
    if not section:
        return text
    start = re.search(rf"^.*--8<-- \[start:{re.escape(section)}\].*\n", text, re.M)
    end = re.search(rf"^.*--8<-- \[end:{re.escape(section)}\].*$", text, re.M)
    assert start and end, f"{file} has no section {section!r}"
    return text[start.end() : end.start()]


def _shown(path: Path) -> str:
    """A page's text as the site renders it: snippet lines replaced by what they include."""
    return re.sub(r'^--8<-- "([^"]+)"$', lambda m: _snippet(m.group(1)), path.read_text(), flags=re.M)


def _pages() -> list[Path]:
    """The site's pages (the package index's long description is not one) and the README."""
    return [REPO / "README.md", *sorted(p for p in DOCS.rglob("*.md") if p.name != "pypi.md")]


def _guides() -> list[Path]:
    """The README and the guide and reference pages: the benchmark pages record past states of the code on purpose."""
    return [p for p in _pages() if "benchmarks" not in p.relative_to(REPO).parts]


def _blocks(language: str) -> list[tuple[Path, str]]:
    """The ```LANGUAGE blocks of every page, those inside list items (indented) included, dedented."""
    return [
        (path, textwrap.dedent(block))
        for path in _pages()
        for _, block in re.findall(rf"^( *)```{language}\n(.*?)^\1```", _shown(path), flags=re.S | re.M)
    ]


def _commands() -> list[tuple[Path, list[str]]]:
    """Every shell command of every bash block, as words (continuation lines joined, comments dropped)."""
    found = []
    for path, block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # an unbalanced quote: not a command line
                continue
            if words:
                found.append((path, words))
    return found


def _cli_words(words: list[str]) -> list[str] | None:
    """The arguments of a ``lightning-rec`` (or ``python -m lightning_rec``) command; None when it is not one."""
    for i, word in enumerate(words):
        if Path(word).name == "lightning-rec":
            return words[i + 1 :]
        if word == "-m" and words[i + 1 : i + 2] == ["lightning_rec"]:
            return words[i + 2 :]
    return None


def _python_words(words: list[str]) -> list[str] | None:
    """``[SCRIPT, args...]`` or ``["-m", MODULE, args...]`` of a Python or torchrun command; None otherwise."""
    for i, word in enumerate(words):
        name = Path(word).name
        if re.fullmatch(r"python(3(\.\d+)?)?", name):
            return words[i + 1 :]
        if name in ("torchrun", "srun"):
            rest = words[i + 1 :]
            if "-m" in rest:
                return rest[rest.index("-m") :]
            scripts = [j for j, w in enumerate(rest) if w.endswith(".py")]
            return rest[scripts[0] :] if scripts else None
    return None


def _options(script: Path) -> set[str]:
    return set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", script.read_text()))


def _concrete(words: list[str]) -> bool:
    """No placeholder (``...``, ``<x>``, a shell variable or substitution) and nothing outside the repository."""
    return not any("..." in w or "$" in w or "<" in w or w.startswith("/tmp/") for w in words)


def _config(args: list[str]) -> str | None:
    for i, word in enumerate(args):
        if word in ("--config", "-c") and i + 1 < len(args):
            return args[i + 1]
        if word.startswith("--config="):
            return word.partition("=")[2]
    return None


def _config_exists(value: str) -> bool:
    from lightning_rec._cli import shipped_config

    return (REPO / value).is_file() or ("/" not in value and shipped_config(value) is not None)


def _run_cli(args: list[str]) -> tuple[int, str]:
    """``lightning-rec ARGS`` in this process, its exit status and what it printed."""
    from lightning_rec._cli import run

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            run(args)
        except SystemExit as exit:
            return int(exit.code or 0), out.getvalue()
    return 0, out.getvalue()


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    """A page left out of mkdocs.yml's nav is unreachable on the site (mkdocs only warns about it)."""

    def entries(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, dict):
            return [e for value in node.values() for e in entries(value)]
        return [e for item in node for e in entries(item)] if isinstance(node, list) else []

    nav = set(entries(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if p.name != "pypi.md"}
    assert nav == pages, (sorted(pages - nav), sorted(nav - pages))


def test_every_python_block_parses():
    blocks = _blocks("python")
    assert len(blocks) >= 5
    for path, block in blocks:
        try:
            ast.parse(block)
        except SyntaxError as err:
            raise AssertionError(f"{path.relative_to(REPO)}: a python block does not parse: {err}\n{block}") from None


def test_every_fit_validate_test_predict_command_parses_with_the_cli(monkeypatch):
    """Each concrete ``lightning-rec fit ...`` the pages show, parsed as the CLI parses it (``--print_config``), from
    the repository root as the pages run them."""
    monkeypatch.chdir(REPO)
    parsed, failures = 0, []
    for path, words in _commands():
        args = _cli_words(words)
        if not args or args[0] not in CLI_SUBCOMMANDS:
            continue
        config = _config(args)
        where = f"{path.relative_to(REPO)}: lightning-rec {shlex.join(args)}"
        if config in PLACEHOLDER_CONFIGS or not _concrete([config or ""]) or (config is None and not _concrete(args)):
            continue  # the reader's own config, or one named through a shell variable
        if config is None or not _config_exists(config):
            failures.append(f"{where}\n  no such config: {config}")
            continue
        if not _concrete(args):
            continue
        code, shown = _run_cli([*args, "--print_config"])
        parsed += 1
        if code != 0:
            failures.append(f"{where}\n  {shown.strip()[-600:]}")
    assert not failures, "\n".join(failures)
    assert parsed >= 15


def test_plan_export_prepare_commands_use_options_they_take():
    helps = {name: _run_cli([name, "--help"]) for name in OWN_SUBCOMMANDS}
    checked, failures = 0, []
    for path, words in _commands():
        args = _cli_words(words)
        if not args or args[0] not in OWN_SUBCOMMANDS:
            continue
        code, shown = helps[args[0]]
        assert code == 0, shown
        offered = set(re.findall(r"(--[a-z][a-z0-9_-]*)", shown))
        used = {a.split("=")[0] for a in args[1:] if a.startswith("--") and not a.startswith(CONFIG_OPTIONS)}
        if used - offered:
            failures.append(f"{path.relative_to(REPO)}: lightning-rec {shlex.join(args)}: {sorted(used - offered)}")
        config = _config(args)
        if config is not None and config not in PLACEHOLDER_CONFIGS and not _config_exists(config):
            failures.append(f"{path.relative_to(REPO)}: lightning-rec {shlex.join(args)}: no such config {config}")
        checked += 1
    assert not failures, "\n".join(failures)
    assert checked >= 5


def test_python_commands_name_scripts_modules_and_tests_that_exist():
    checked, failures = 0, []
    for path, words in _commands():
        rest = _python_words(words)
        if rest is None or _cli_words(words) is not None or not rest or rest[0] == "-c" or not _concrete(rest):
            continue
        where = f"{path.relative_to(REPO)}: {shlex.join(words)}"
        if rest[0] == "-m" and rest[1] == "pytest":
            tests = [w.split("::")[0] for w in rest[2:] if w.startswith("tests/")]
            failures += [f"{where}: no {t}" for t in tests if not (REPO / t).exists()]
        elif rest[0] == "-m":
            if importlib.util.find_spec(rest[1]) is None:
                failures.append(f"{where}: no module {rest[1]}")
            script = SCRIPTS.get(rest[1])
            if script is not None:
                unknown = {a.split("=")[0] for a in rest[2:] if a.startswith("--")} - _options(script)
                failures += [f"{where}: {script.name} takes no {sorted(unknown)}"] if unknown else []
        else:
            script = REPO / rest[0]
            if not script.is_file():
                failures.append(f"{where}: no {rest[0]}")
                continue
            unknown = {a.split("=")[0] for a in rest[1:] if a.startswith("--")} - _options(script)
            failures += [f"{where}: {rest[0]} takes no {sorted(unknown)}"] if unknown else []
        checked += 1
    assert not failures, "\n".join(failures)
    assert checked >= 10


_PATH = re.compile(r"(?<![\w/.])((?:lightning_rec|tests|examples|benchmarks|scripts|requirements)/[\w/.-]*[\w/])")


def test_the_files_the_guides_point_to_exist():
    """``lightning_rec/_strategy/faults.py``, ``tests/test_pretrained.py``, ``examples/serve_cpp/``...: a reader sent
    there finds the file (``::test_name`` and ``:line`` suffixes are not part of the path)."""
    checked, missing = 0, []
    for path in _guides():
        text = re.sub(r"\]\([^)]*\)", "]", _shown(path))  # a link's target is the site's, which mkdocs checks
        for name in set(_PATH.findall(text)):
            checked += 1
            if not (REPO / name).exists():
                missing.append(f"{path.relative_to(REPO)}: {name}")
    assert not missing, "\n".join(sorted(missing))
    assert checked >= 40


def test_the_package_layout_names_modules_that_exist():
    """docs/layout.md's map of the package: every ``name.py`` and ``folder/`` it lists is in lightning_rec/ (where
    the map puts it, or in a folder of the package, as docs/architecture.md's test checks its own; ``benchmarks/`` is
    the repository's)."""
    (block,) = re.findall(r"^```\n(lightning_rec/\n.*?)^tests/", (DOCS / "layout.md").read_text(), flags=re.S | re.M)
    names = set(re.findall(r"(?<![\w/.])([a-z_][a-z0-9_]*(?:\.py|/))(?=[\s,)]|$)", block, flags=re.M))
    names -= {"lightning_rec/"}
    assert len(names) > 30
    missing = [
        n
        for n in sorted(names)
        if not (PACKAGE / n).exists() and not any(PACKAGE.glob(f"**/{n.rstrip('/')}")) and not (REPO / n).is_dir()
    ]
    assert not missing, f"docs/layout.md names what lightning_rec/ does not have: {missing}"


def test_every_included_readme_or_benchmarks_section_is_there():
    """The sections of README.md and BENCHMARKS.md that pages include (home, install, quickstart, layout, the
    benchmarks' index) are still marked there and not empty: renaming a README section must not empty a page."""
    targets = [t for path in _pages() for t in re.findall(r'^--8<-- "([^"]+)"$', path.read_text(), flags=re.M)]
    assert len(targets) >= 8
    for target in targets:
        assert _snippet(target).strip(), target


def test_ci_runs_the_readmes_set_up_and_test_commands():
    """``.ci/run`` is what a new user does: the README's set-up command, then its test command (the whole suite,
    every tier), each as written."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    block = next(b for b in blocks if "scripts/setup.sh" in b and "pytest" in b)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    ci = [line.split("#")[0].strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert commands and all(command in ci for command in commands), (commands, ci)
    assert any('-m ""' in command for command in commands), "the README's test command leaves a tier out"
