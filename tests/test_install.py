"""The package as a user installs it: the wheel built from this checkout, installed into a new virtual environment,
run from an empty directory (`lightning-rec --help`, the README quickstart, `lightning-rec fit --config NAME` of a
shipped config), and refusing in one line to import without TorchRec or FBGEMM.

Slow tier (``dist``, about a minute): it builds a wheel and starts processes, 2-rank trainings among them. Offline:
the wheel is installed with ``--no-deps --no-index``, and the new environment reads its dependencies from this one's
site-packages through a ``.pth`` line, since this machine reaches PyPI only, not the PyTorch CPU index whose builds a
user installs. So what pip would install is checked separately: every requirement the wheel declares holds for the
versions installed here, and agrees with torchrec's own pins.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI
from packaging.requirements import Requirement

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.name for p in (REPO / "lightning_rec" / "configs").glob("*.yaml"))
OWN_COMMANDS = {"plan", "export", "prepare", "index"}  # the ones lightning_rec._cli.run handles before LightningCLI
INDEX_HINT = "pip install lightning-rec --extra-index-url https://download.pytorch.org/whl/cpu"
# An import blocker, loaded at start-up (sitecustomize) by every Python process of a test that puts it on PYTHONPATH.
BLOCKER = """
import importlib.abc, importlib.util, os, sys

BLOCKED = set(os.environ["BLOCK_IMPORTS"].split(","))
BROKEN = os.environ.get("BLOCK_MODE") == "broken"


class _Broken(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise OSError("libnvidia-ml.so.1: cannot open shared object file: No such file or directory")


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in BLOCKED:
            return None
        if BROKEN:  # installed, but its library does not load (the CUDA FBGEMM without a driver)
            return importlib.util.spec_from_loader(name, _Broken())
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, _Blocker())
"""


def _source_tree(dest: Path) -> Path:
    """This checkout's files (tracked, and untracked but not ignored), copied: the build writes its build/ and
    .egg-info/ there, not into the working tree."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if not os.path.lexists(src) or any((REPO / p).is_symlink() for p in Path(rel).parents if p != Path(".")):
            continue  # deleted, or reached through a linked folder (examples/configs): the link itself is copied
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel, follow_symlinks=False)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("build")
    source = _source_tree(work / "src")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
        + ["-w", str(work / "dist"), str(source)],
        check=True,
        timeout=300,
    )
    (built,) = (work / "dist").glob("lightning_rec-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment with the wheel installed, its dependencies read from this environment."""
    root = tmp_path_factory.mktemp("venv") / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
        timeout=300,
    )
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    here = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    # Appended after the venv's own site-packages, and its .pth files are not run: the editable install of this
    # checkout that lives there stays out, and lightning_rec is the wheel's.
    (Path(site) / "_dependencies_from_the_test_environment.pth").write_text("\n".join(here) + "\n")
    return root


def _run(venv: Path, args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300):
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    base.update(PATH=f"{venv / 'bin'}{os.pathsep}{base.get('PATH', '')}", VIRTUAL_ENV=str(venv), PYTHONNOUSERSITE="1")
    return subprocess.run(args, cwd=cwd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def empty(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def _blocking(tmp_path: Path, modules: str, mode: str = "missing") -> dict[str, str]:
    (tmp_path / "blocker").mkdir(exist_ok=True)
    (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCKER)
    return {"PYTHONPATH": str(tmp_path / "blocker"), "BLOCK_IMPORTS": modules, "BLOCK_MODE": mode}


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(z.read(name).decode()), z.namelist()


def test_the_wheel_ships_license_types_configs_urls_and_an_index_description(wheel: Path) -> None:
    meta, names = _metadata(wheel)
    assert any(re.fullmatch(r"lightning_rec-[^/]+\.dist-info/licenses/LICENSE", n) for n in names), names
    assert meta["License-Expression"] == "Apache-2.0"
    assert "lightning_rec/py.typed" in names
    assert "_lightning_rec_cli.py" in names  # the console script's light entry point
    assert sorted(n.rpartition("/")[2] for n in names if n.startswith("lightning_rec/configs/")) == SHIPPED
    # One source: the repository's examples/configs is the package's folder.
    assert (REPO / "examples" / "configs").resolve() == (REPO / "lightning_rec" / "configs").resolve()
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert {"Homepage", "Source", "Issues"} <= set(urls) and all(u.startswith("https://") for u in urls.values())
    description = meta.get_payload()
    assert description.strip() == (REPO / "docs" / "pypi.md").read_text().strip()
    assert ".venv/bin" not in description
    relative = [t for t in re.findall(r"\]\(([^)]*)\)", description) if not t.startswith(("https://", "#"))]
    assert not relative, f"links a package index cannot follow: {relative}"
    assert INDEX_HINT in description


def test_declared_requirements_hold_here_and_agree_with_torchrecs_pins(wheel: Path) -> None:
    """What pip would install for a user, as far as it can be checked offline: each requirement admits the version
    tested here (PyPI's CPU FBGEMM, ``fbgemm-gpu-cpu``, stands for ``fbgemm-gpu``: one import package, two names),
    and each version torchrec pins exactly is one our requirement admits (torchmetrics: torchrec's ``==1.0.3``)."""
    meta, _ = _metadata(wheel)
    requirements = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    runtime = [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    assert {"torch", "torchrec", "fbgemm-gpu", "lightning", "torchmetrics"} <= {r.name for r in runtime}
    unmet = []
    for r in runtime:
        names = [r.name, "fbgemm-gpu-cpu"] if r.name == "fbgemm-gpu" else [r.name]
        versions = [v for v in map(_installed, names) if v is not None]
        if not any(r.specifier.contains(v, prereleases=True) for v in versions):
            unmet.append(f"{r} (installed: {versions or 'none'})")
    assert not unmet, unmet
    ours = {r.name.lower(): r for r in runtime}
    # One release line, pinned together: FBGEMM's kernels load only with the torch they were built for.
    line = {name: str(ours[name].specifier) for name in ("torch", "torchrec", "fbgemm-gpu")}
    assert all(re.fullmatch(r"==\d+\.\d+\.\*", spec) for spec in line.values()), line
    assert line["torchrec"] == line["fbgemm-gpu"], line  # FBGEMM and TorchRec release together, numbered alike
    pins = [Requirement(r) for r in metadata.requires("torchrec") or []]
    pinned = [(p, s.version) for p in pins if p.marker is None for s in p.specifier if s.operator == "=="]
    assert any(p.name == "torchmetrics" for p, _ in pinned), "torchrec no longer pins torchmetrics: revisit pyproject"
    clashes = [
        f"torchrec pins {p}, lightning-rec asks {ours[p.name.lower()]}"
        for p, v in pinned
        if p.name.lower() in ours and not ours[p.name.lower()].specifier.contains(v)
    ]
    assert not clashes, clashes


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_the_installed_package_is_the_wheels(venv: Path, empty: Path) -> None:
    found = _run(
        venv,
        ["python", "-c", "import importlib.util as u; print(u.find_spec('lightning_rec').origin)"],
        cwd=empty,
    )
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()).is_relative_to(venv), found.stdout


def test_help_answers_fast_without_torch_torchrec_or_lightning(venv: Path, empty: Path, tmp_path: Path) -> None:
    started = time.perf_counter()
    shown = _run(venv, ["lightning-rec", "--help"], cwd=empty)
    took = time.perf_counter() - started
    assert shown.returncode == 0, shown.stderr
    assert took < 1.5, f"lightning-rec --help took {took:.2f} s"
    listed = set(re.findall(r"^  (\w+)  ", shown.stdout, re.M))
    assert listed == set(LightningCLI.subcommands()) | OWN_COMMANDS, shown.stdout
    for name in SHIPPED:
        assert name.removesuffix(".yaml") in shown.stdout
    # Not one heavy import: the same help with torch, TorchRec, FBGEMM, Lightning and jsonargparse refused.
    blocked = _run(
        venv,
        ["lightning-rec", "--help"],
        cwd=empty,
        env=_blocking(tmp_path, "torch,torchrec,fbgemm_gpu,lightning,pytorch_lightning,jsonargparse"),
    )
    assert blocked.returncode == 0 and blocked.stdout == shown.stdout, blocked.stderr


def test_the_quickstart_runs_from_an_empty_directory(venv: Path, empty: Path) -> None:
    """examples/quickstart.py as docs/quickstart.md shows it whole (the README shows its model)."""
    (empty / "quickstart.py").write_text((REPO / "examples" / "quickstart.py").read_text())
    run = _run(venv, ["python", "quickstart.py", "--devices", "2", "--max-epochs", "1", "--root-dir", "run"], empty)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert float(re.search(r"final train_loss=([0-9.]+)", run.stdout).group(1)) < 0.4  # starts at ~0.69
    checkpoint = empty / re.search(r"checkpoint=(.*)", run.stdout).group(1)
    assert {p.name.split("_")[2] for p in checkpoint.glob("*.distcp")} == {"0", "1"}  # both ranks wrote shards


def test_fit_a_shipped_config_by_name_from_an_empty_directory(venv: Path, empty: Path) -> None:
    run = _run(
        venv,
        ["lightning-rec", "fit", "--config", "synthetic_dlrm", "--trainer.max_steps=3"]
        + [
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false",
        ],
        cwd=empty,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    logs = empty / "runs" / "synthetic_dlrm" / "lightning_logs" / "version_0"  # the config's default_root_dir
    assert (logs / "metrics.csv").is_file() and "DLRMModule" in (logs / "config.yaml").read_text()
    wrong = _run(venv, ["lightning-rec", "fit", "--config", "dlrm"], cwd=empty)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1, wrong.stderr
    assert "criteo_dlrm, movielens_dlrm, synthetic_dlrm" in wrong.stderr


@pytest.mark.parametrize(
    ("blocked", "mode", "says"),
    [
        ("torchrec", "missing", "`torchrec` is not installed"),
        ("fbgemm_gpu", "missing", "`fbgemm_gpu` is not installed"),
        ("fbgemm_gpu", "broken", "do not load here (libnvidia-ml.so.1: cannot open shared object file"),
    ],
)
def test_without_the_torchrec_stack_one_line_says_what_to_install(
    venv: Path, empty: Path, tmp_path: Path, blocked: str, mode: str, says: str
) -> None:
    env = _blocking(tmp_path, blocked, mode)
    imported = _run(venv, ["python", "-c", "import lightning_rec"], cwd=empty, env=env)
    assert imported.returncode == 1
    last = imported.stderr.strip().splitlines()[-1]
    error = "ModuleNotFoundError" if mode == "missing" else "ImportError"
    assert last.startswith(f"{error}: lightning_rec needs PyTorch, TorchRec and FBGEMM"), imported.stderr
    assert says in last and INDEX_HINT in last, last
    assert "During handling" not in imported.stderr  # no chained traceback of the original error
    if mode == "missing" and blocked == "torchrec":  # the console script prints that line alone
        cli = _run(venv, ["lightning-rec", "fit", "--config", "synthetic_dlrm"], cwd=empty, env=env)
        assert cli.returncode == 1 and cli.stderr.count("\n") == 1, cli.stderr
        assert cli.stderr.startswith("lightning-rec: error: lightning_rec needs") and INDEX_HINT in cli.stderr
