"""The docs site as CI builds it (issue 44): ``.ci/run``'s own ``mkdocs build`` command passes on the pages as they
are, fails on a page with one warning (no flag may drop warnings before ``--strict`` counts them), and the Quickstart
page it renders shows the whole of ``examples/quickstart.py`` (a formatter once rewrote its include line into
``--8 < --"..."``, and the page showed that instead)."""

from __future__ import annotations

import html
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from lightning_rec.testing import shell_env
from tests.helpers.data import REPO


def _ci_docs_command() -> tuple[dict[str, str], list[str]]:
    """The environment and argv of the ``mkdocs build`` line in ``.ci/run``, as CI runs it."""
    lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if "mkdocs build" in line]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0], comments=True)
    env = dict(word.split("=", 1) for word in words if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word))
    return env, [word for word in words if word.split("=", 1)[0] not in env]


def _build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env, argv = _ci_docs_command()
    if "--site-dir" in argv:
        argv[argv.index("--site-dir") + 1] = str(site)
    else:
        argv += ["--site-dir", str(site)]
    argv[0] = str(REPO / argv[0])  # .venv/bin/mkdocs, from the repository
    return subprocess.run(
        argv, cwd=root, env={**shell_env(), **env}, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    out = _build(REPO, site)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return site


def _text(page: Path) -> str:
    """A rendered page's text: tags dropped, entities decoded (code is split into highlighted spans)."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


@pytest.mark.dist
def test_the_quickstart_page_shows_the_whole_script(site: Path) -> None:
    shown = _text(site / "quickstart" / "index.html")
    script = (REPO / "examples" / "quickstart.py").read_text()
    missing = [line for line in script.splitlines() if line.strip() and line.strip() not in shown]
    assert not missing, missing[:10]
    assert "--8" not in shown  # no include line left as text


@pytest.mark.dist
def test_no_page_shows_an_include_line(site: Path) -> None:
    shown = {page.relative_to(site): _text(page) for page in site.rglob("*.html")}
    assert [page for page, text in shown.items() if re.search(r"--8\s*<\s*--", text)] == []


@pytest.mark.dist
def test_ci_fails_the_docs_on_a_single_warning(tmp_path: Path) -> None:
    """One page with one broken link (a warning, not an error, for mkdocs): CI's command fails."""
    env, argv = _ci_docs_command()
    assert "--strict" in argv and not {"-q", "--quiet"} & set(argv), argv
    root = tmp_path / "repo"
    root.mkdir()
    for name in ("mkdocs.yml", "README.md", "examples", "lightning_rec", "pyproject.toml"):
        (root / name).symlink_to(REPO / name)
    shutil.copytree(REPO / "docs", root / "docs")
    page = root / "docs" / "limits.md"
    page.write_text(page.read_text() + "\nSee [a page that is not there](no-such-page.md).\n")
    out = _build(root, tmp_path / "site")
    assert out.returncode != 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "no-such-page.md" in out.stdout + out.stderr
