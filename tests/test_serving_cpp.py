"""The C++ example (``examples/serve_cpp``) as the Serving page (``docs/serving.md``) builds and runs it: its bash block runs as
written (from a folder laid out like the repository root: the example, ``.venv``, the artifacts; only the package's
name differs, its tables being fp32), building once per module against the installed libtorch; the program then serves a trained DeepFM's held-out samples from
the TorchScript artifact and from the ``.pt2`` package as Python does (the fp32 package: the trained module's
``predict`` probabilities to 1e-6), and refuses a package compiled under another torch. ``examples/serve.py``
serves the package in a process without lightning_rec or torchrec. The same build's ``hash_ids``
(``examples/serve_cpp/hash_ids.h``) hashes raw ids to the rows Python's request encoding gives them. ``serve --follow``
follows a publish directory (the fp32 package as version 1, deltas written with ``lightning_rec.serving.deltas`` from
two more training states): each version answers as its training state and as ``FreshModel`` does, a missing or
damaged delta is refused by name, and requests running while a version is applied never see part of it."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import fbgemm_gpu
import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_rec import RecShardStrategy
from lightning_rec.config import EmbeddingOptimizer
from lightning_rec.models import DeepFMModule
from lightning_rec.serving import (
    FreshModel,
    InferenceSpec,
    encode_request,
    export_inference,
    load_inference,
    load_pt2,
    serving_inputs,
)
from lightning_rec.serving.cpu import host_features
from lightning_rec.serving.deltas import (
    LATEST_FILE,
    Manifest,
    artifact_rows,
    file_record,
    full_manifest_path,
    full_path,
    version_dir,
    write_part,
)
from lightning_rec.serving.integrity import MANIFEST_RECORD, seal
from lightning_rec.serving.requests import raw_inputs_record
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers import zoo_deepfm, zoo_two_tower
from tests.helpers.data import REPO
from tests.helpers.dist import in_this_process
from tests.helpers.serving import serve_fresh
from tests.helpers.zoo import ZooCase, seeded_module
from tests.test_serving_pt2 import _rewritten, _tampered

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("c++")), reason="needs cmake and a C++ compiler"),
]

FBGEMM_GPU_DIR = str(Path(fbgemm_gpu.__file__).parent)


def readme_commands() -> str:
    """README's bash block that builds and runs the C++ example (on the docs site's Serving page, ``docs/serving.md``),
    serving ``model.pt2`` where it names ``model_int8.pt2`` (the package here has fp32 tables: see ``served``)."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "docs" / "serving.md").read_text(), re.S)
    (block,) = [b for b in blocks if "cmake -S examples/serve_cpp" in b]
    assert block.count(" model_int8.pt2 ") == 1, block
    return block.replace(" model_int8.pt2 ", " model.pt2 ")


def _fast_deepfm() -> DeepFMModule:
    """The zoo's DeepFM with ten times its learning rates, so that 4 steps make the tables matter."""
    fast = {"embedding_optimizer": EmbeddingOptimizer("rowwise_adagrad", lr=0.5), "dense_lr": 0.01}
    return DeepFMModule(**{**zoo_deepfm.CASE.build().hparams, **fast})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A DeepFM trained 4 steps (:func:`_fast_deepfm`) on one process, exported as ``model_int8.pt`` (TorchScript,
    int8 tables, as README names it) and ``model.pt2`` (fp32 tables, so that it must give the trained module's
    outputs); then README's commands, run in a folder holding what they need."""
    work = tmp_path_factory.mktemp("serve_cpp")
    case = ZooCase(**{**zoo_deepfm.CASE.__dict__, "build": _fast_deepfm})
    module = seeded_module(case)
    with in_this_process(work):  # this fixture runs before conftest's per-test isolation
        trainer = L.Trainer(strategy=RecShardStrategy(), accelerator="cpu", devices=1, max_steps=4, **QUIET_TRAINER)
        trainer.fit(module, DataLoader(case.batches(4), batch_size=None, collate_fn=lambda b: b))
        trainer.save_checkpoint(work / "ckpt")
    export_inference(work / "ckpt", work / "model_int8.pt", table_dtype="int8")
    start = time.perf_counter()
    spec = export_inference(work / "ckpt", work / "model.pt2", table_dtype="fp32")
    export_s = time.perf_counter() - start

    shutil.copytree(REPO / "examples" / "serve_cpp", work / "examples" / "serve_cpp")
    (work / ".venv").symlink_to(sys.prefix)  # the interpreter running the tests, where README's .venv would be
    start = time.perf_counter()
    out = subprocess.run(["bash", "-e", "-c", readme_commands()], cwd=work, capture_output=True, text=True, timeout=600)
    readme_s = time.perf_counter() - start
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(f"pt2 export {export_s:.1f} s; README's commands (cmake configure, build, 2 runs) {readme_s:.1f} s")
    trained = type(module).load_from_checkpoint(work / "ckpt").eval()
    return SimpleNamespace(work=work, spec=spec, stdout=out.stdout, trained=trained, heldout=case.heldout())


def serve(
    served, artifact: str | Path, requests: str = "", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The C++ server on ``artifact``, given ``requests`` (lines) on its standard input until it ends."""
    cmd = [str(served.work / "build" / "serve_cpp" / "serve"), str(artifact), FBGEMM_GPU_DIR]
    return subprocess.run(
        cmd, input=requests, capture_output=True, text=True, timeout=120, cwd=served.work, env=env or os.environ.copy()
    )


def request(*args: torch.Tensor, dense: bool = True, weights: bool = False) -> str:
    """One request line for the C++ server from an artifact's arguments (``[dense_features,] values, lengths[,
    weights]``)."""
    names = ["dense", "values", "lengths", "weights"][(0 if dense else 1) :][: len(args)]
    return "; ".join(f"{n}: " + " ".join(repr(v) for v in a.reshape(-1).tolist()) for n, a in zip(names, args)) + "\n"


def outputs(stdout: str) -> list[torch.Tensor]:
    return [torch.tensor([float(v) for v in line.split()[1:]]) for line in stdout.splitlines() if line[:7] == "output:"]


def python_model(path: Path):
    return load_pt2(path) if path.suffix == ".pt2" else load_inference(path)


def test_readme_commands_build_a_libtorch_only_program_that_serves_both_formats(served):
    """README's block ran (the fixture); its two runs (2 samples of dense zeros and id 0 of every feature) print the
    spec and what Python predicts for those inputs; the program needs libtorch, not libpython."""
    assert served.stdout.count("spec: {") == 2 and '"format": "pt2"' in served.stdout
    features = len(served.spec.features)
    args = (torch.zeros(2, 2), torch.zeros(2 * features, dtype=torch.long), torch.ones(2 * features, dtype=torch.int))
    with torch.inference_mode():
        want = [python_model(served.work / name)(*args).reshape(-1) for name in ("model_int8.pt", "model.pt2")]
    got = outputs(served.stdout)
    assert len(got) == 2 and all(g.shape == (2,) for g in got), served.stdout
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=0, atol=1e-6), (g, w)
    if shutil.which("ldd"):
        ldd = subprocess.run(
            ["ldd", str(served.work / "build" / "serve_cpp" / "serve")], capture_output=True, text=True
        )
        linked = [line.split()[0] for line in ldd.stdout.splitlines() if line.strip()]  # with what they need
        assert "libtorch_cpu.so" in linked and not [n for n in linked if "python" in n], ldd.stdout


@pytest.mark.parametrize("name", ["model_int8.pt", "model.pt2"])
def test_cpp_serves_held_out_samples_like_python(served, name, tmp_path):
    """Held-out samples that each bring their own ids (one or several per feature) and dense values: C++ predicts
    what Python's loader predicts; the fp32 package predicts the trained module's ``predict`` probabilities. Feature
    order, row lookup and the samples' layout all show in the outputs."""
    spec, heldout = served.spec, served.heldout
    dense, values, lengths = serving_inputs(spec, heldout.sparse_features, heldout.dense_features)
    rows, features = dense.shape[0], len(spec.features)
    assert len(dense.unique(dim=0)) > 1 and len(values) > features * rows and len(values.unique()) > rows
    out = serve(served, served.work / name, request(dense, values, lengths))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (cpp,) = outputs(out.stdout)
    with torch.inference_mode():
        want = python_model(served.work / name)(dense, values, lengths).reshape(-1)
    assert want.max() - want.min() > 0.1, "the samples' outputs must differ for their order to show"
    assert cpp.shape == want.shape and torch.allclose(cpp, want, rtol=0, atol=1e-6), (cpp - want).abs().max()
    if name.endswith(".pt2"):  # fp32 tables
        with torch.no_grad():
            trained = served.trained.predict_step(copy.deepcopy(heldout), 0)["probability"].reshape(-1)
        assert torch.allclose(cpp, trained, rtol=0, atol=1e-6), (cpp - trained).abs().max()


def test_a_package_from_another_torch_is_refused_by_cpp_and_by_serve_py(served, tmp_path):
    """The package with another torch version recorded (every record that holds its spec rewritten): the C++
    program names both versions and exits 1 before running anything; ``examples/serve.py`` refuses it too."""
    other = "2.12.0+cpu"
    assert torch.__version__ != other
    bad = tmp_path / "other_torch.pt2"
    with zipfile.ZipFile(served.work / "model.pt2") as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(".json"):
                data = data.replace(torch.__version__.encode(), other.encode())
            if not info.filename.endswith(MANIFEST_RECORD):
                dst.writestr(info, data)
    seal(bad)  # as that torch's export would have written it
    out = serve(served, bad)
    assert out.returncode == 1 and "output:" not in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"compiled under torch 2.12.0 and this program runs under libtorch {torch.__version__.split('+')[0]}" in (
        out.stderr
    ), out.stderr
    py = subprocess.run(
        [sys.executable, str(REPO / "examples" / "serve.py"), str(bad), str(tmp_path / "in.pt"), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert py.returncode != 0 and f"compiled under torch {other}, this is torch {torch.__version__}" in py.stderr, (
        py.stderr[-3000:]
    )


def test_serve_py_serves_the_package_without_lightning_rec(served, tmp_path):
    """``examples/serve.py``, in a process that cannot import lightning_rec, torchrec or lightning, predicts the
    held-out samples from the ``.pt2`` package as :func:`load_pt2` does."""
    args = serving_inputs(served.spec, served.heldout.sparse_features, served.heldout.dense_features)
    (got,) = serve_fresh([(served.work / "model.pt2", [args])], tmp_path)
    with torch.inference_mode():
        want = load_pt2(served.work / "model.pt2")(*args)
    assert torch.equal(got, want)


# Raw ids a request may bring for an `ids: hash` feature: integers (negative, the int64 extremes) and text (unicode,
# empty, integer-looking text, which is the integer, and text that only looks close to one).
RAW_INTS = [0, 1, -1, 42, -7, -(2**63), 2**63 - 1, 987_654_321_012]
RAW_TEXTS = ["", "a", "user-42", "crème brûlée", "商品", "🙂", "tv ☂", "42", "-7", "007", "-0", "+4", "4.0", " 4",
             str(2**63), str(2**64 - 1), str(2**64), "-" + str(2**63), "-" + str(2**63 + 1)]  # fmt: skip


def test_cpp_hashes_raw_ids_to_the_rows_the_python_request_encoding_gives(served):
    """``hash_ids`` (built by the Serving page's commands) against :func:`encode_request` of an artifact spec
    recording one ``ids: hash`` feature, computed now (whatever the DataModule's hashing is today): every id, of
    every kind, goes to the same row, for several table sizes."""
    lines = [f"int {v}" for v in RAW_INTS] + [f"text {t}" for t in RAW_TEXTS]
    for rows in (1, 97, 1_000_003, 2**40 + 15):
        state = {
            "schema": {
                "labels": [{"column": "y"}],
                "sparse": [{"column": "id", "ids": "hash", "num_embeddings": rows}],
            },
            "vocabularies": {},
            "dense_stats": {},
        }
        spec = InferenceSpec(["id"], 0, False, "fp32", {}, "users.Model", raw_inputs=raw_inputs_record(state))
        want = [encode_request(spec, {"id": ids})[0].tolist() for ids in (RAW_INTS, RAW_TEXTS)]
        out = subprocess.run(
            [str(served.work / "build" / "serve_cpp" / "hash_ids"), str(rows)],
            input="".join(f"{line}\n" for line in lines),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        got = [int(v) for v in out.stdout.split()]
        assert got == want[0] + want[1], [(line, g, w) for line, g, w in zip(lines, got, want[0] + want[1]) if g != w]


def _python_answer(path: Path, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    with torch.inference_mode():
        return python_model(path)(*args).reshape(-1)


@pytest.mark.parametrize("name", ["model_int8.pt", "model.pt2"])
def test_a_bad_request_is_answered_with_its_error_and_the_server_goes_on(served, name, tmp_path):
    """One process, one request per line: every kind of bad request (feature count, dense width, an id outside its
    table, a negative length, lengths that do not add up, text for a number, an unknown section, weights the
    artifact does not read, an empty batch) is answered by one error line naming it, between good requests that are
    answered as Python's loader answers them; the input's end is a clean exit with nothing left in the temp
    directory."""
    spec, F = served.spec, len(served.spec.features)
    dense, values, lengths = serving_inputs(spec, served.heldout.sparse_features, served.heldout.dense_features)
    good = request(dense, values, lengths)
    rows = spec.feature_rows
    one = torch.ones(F, dtype=torch.long)
    bad = {
        request(torch.zeros(1, 2), torch.zeros(F - 1, dtype=torch.long), one[1:]): rf"lengths has {F - 1} entries; "
        rf"the artifact reads {F} features",
        request(torch.zeros(1, 3), torch.zeros(F, dtype=torch.long), one): r"dense has 3 values; lengths holds 1 "
        r"samples and the artifact reads 2 dense features, so it expects 2",
        request(torch.zeros(1, 2), torch.tensor([0] * (F - 1) + [rows[-1]]), one): rf"feature '{spec.features[-1]}'"
        rf": id {rows[-1]} is outside its table of {rows[-1]} rows",
        request(torch.zeros(1, 2), torch.tensor([-1] + [0] * (F - 1)), one): rf"feature '{spec.features[0]}': id -1",
        request(torch.zeros(1, 2), torch.zeros(F, dtype=torch.long), torch.tensor([2, -1] + [1] * (F - 2))): "lengths "
        "holds a negative length",
        request(torch.zeros(1, 2), torch.zeros(F + 1, dtype=torch.long), one): rf"lengths add up to {F} ids, but "
        rf"values holds {F + 1}",
        good.replace("values: ", "values: x", 1): r"values: 'x[0-9]+' is not an integer",
        "dense: 0 0; lenghts: 1; values: 0\n": r"'lenghts' is not a section",
        good.rstrip("\n") + "; weights: 1\n": r"the artifact reads no weights",
        good.replace("lengths:", "values: 1; lengths:", 1): r"section 'values' given twice",
    }
    lines = [good, *bad, "\n", "dense: ; lengths: ; values: \n", good]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = serve(served, served.work / name, "".join(lines), env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    answers = [line for line in out.stdout.splitlines() if not line.startswith("spec: ")]
    assert len(answers) == len(bad) + 3, answers  # the blank line is skipped
    want = _python_answer(served.work / name, (dense, values, lengths))
    for answer in (answers[0], answers[-1]):
        assert answer.startswith("output:") and torch.allclose(outputs(answer)[0], want, rtol=0, atol=1e-6)
    for answer, message in zip(answers[1:-2], bad.values()):
        assert answer.startswith("error: ") and re.search(message, answer), (answer, message)
    assert answers[-2] == "output:"  # no samples: no outputs
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def query_tower(served):
    """The zoo's two-tower model trained 2 steps in this process, its query tower (a collection pooled with per-id
    weights) exported as a TorchScript artifact."""
    from tests.test_serving import trained_checkpoint

    case = zoo_two_tower.CASE
    with in_this_process(served.work):
        ckpt = trained_checkpoint(case.build(), case.batches(2), served.work / "two_tower_ckpt")
    spec = export_inference(ckpt, served.work / "query.pt", table_dtype="fp32", part="query")
    assert spec.weighted
    return SimpleNamespace(path=served.work / "query.pt", spec=spec, heldout=case.heldout()["query"])


def test_cpp_serves_per_id_weights(served, query_tower):
    """The query tower reads per-id weights: sent as the request's ``weights``, C++ answers what Python does (the
    embeddings, row-major); other weights give other answers; a request without them is refused by name."""
    values, lengths, weights = serving_inputs(query_tower.spec, query_tower.heldout)
    assert len(weights.unique()) > 1
    lines = [
        request(values, lengths, weights, dense=False),
        request(values, lengths, torch.ones_like(weights), dense=False),
        request(values, lengths, dense=False),
        request(values, lengths, weights[:-1], dense=False),
    ]
    out = serve(served, query_tower.path, "".join(lines))
    assert out.returncode == 0, out.stderr[-3000:]
    answers = [line for line in out.stdout.splitlines() if not line.startswith("spec: ")]
    weighted, unweighted = outputs("\n".join(answers[:2]))
    assert torch.allclose(weighted, _python_answer(query_tower.path, (values, lengths, weights)), rtol=0, atol=1e-6)
    assert torch.allclose(unweighted, _python_answer(query_tower.path, (values, lengths, torch.ones_like(weights))))
    assert not torch.allclose(weighted, unweighted, atol=1e-4)
    assert answers[2] == "error: the artifact reads per-id weights: add 'weights: ...'"
    assert answers[3].startswith(f"error: weights has {len(weights) - 1} entries, values {len(weights)}")


def _running(served, artifact: Path, tmp: Path) -> subprocess.Popen:
    """The server started with ``tmp`` as its temp directory, once it has printed its spec (it is serving)."""
    cmd = [str(served.work / "build" / "serve_cpp" / "serve"), str(artifact), FBGEMM_GPU_DIR]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )  # fmt: skip
    line = proc.stdout.readline()  # blocks until the program is ready (or has ended)
    assert line.startswith("spec: "), line + proc.stderr.read()
    return proc


def test_the_unpacked_package_is_removed_on_every_exit_path(served, tmp_path):
    """The package's unpacked files (in $TMPDIR, one directory per process) are there while it serves and gone
    after the end of the input, SIGTERM, SIGINT, a crash (SIGSEGV, SIGABRT) and a refused start; SIGKILL cannot be
    caught and leaves one directory, which the next start removes (its process is gone)."""
    package = served.work / "model.pt2"
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGSEGV, signal.SIGABRT):
        proc = _running(served, package, tmp_path)
        (unpacked,) = tmp_path.iterdir()
        assert unpacked.name == f"lightning_rec_serve.{proc.pid}" and any(unpacked.rglob("*.so"))
        proc.send_signal(sig)
        proc.communicate(timeout=60)
        assert proc.returncode == -sig, (sig, proc.returncode)
        assert list(tmp_path.iterdir()) == [], sig
    proc = _running(served, package, tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    assert [p.name for p in tmp_path.iterdir()] == [f"lightning_rec_serve.{proc.pid}"]
    out = serve(served, package, "", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0 and list(tmp_path.iterdir()) == [], out.stderr[-3000:]
    bad = _tampered(package, tmp_path.parent / "refused.pt2", ".so", rewrite=False)  # refused once unpacking
    out = serve(served, bad, "", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 1 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("name", "suffix"), [("model.pt2", ".so"), ("model.pt2", "_weights.blob"), ("model_int8.pt", "data/0")]
)
def test_cpp_and_serve_py_refuse_a_modified_file_by_name(served, tmp_path, name, suffix):
    """One flipped bit in the compiled library, the tables' blob or a TorchScript tensor: the C++ server (and
    ``examples/serve.py``) refuses the file before loading it, naming the record, within seconds, and serves
    nothing."""
    bad = _tampered(served.work / name, tmp_path / f"bad{Path(name).suffix}", suffix, rewrite=False)
    start = time.perf_counter()
    out = serve(served, bad, "dense: 0 0; lengths: 1; values: 0\n", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert time.perf_counter() - start < 30
    assert out.returncode == 1 and "output:" not in out.stdout and "spec:" not in out.stdout, out.stdout[-2000:]
    assert re.fullmatch(rf"\S*bad\.pt2? was modified after export: its record '[^']*{re.escape(suffix)}' has SHA-256 \S+, "
                        r"its manifest records \S+; refusing to serve it\. .*\n", out.stderr), out.stderr  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == [bad.name]
    py = subprocess.run(
        [sys.executable, str(REPO / "examples" / "serve.py"), str(bad), str(tmp_path / "in.pt"), str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert py.returncode != 0 and re.search(
        rf"(modified after export|is damaged): its record '[^']*{re.escape(suffix)}'", py.stderr
    ), py.stderr[-2000:]


def test_cpp_refuses_a_cpu_without_the_packages_features_in_one_line(served, tmp_path):
    """A package whose spec requires an instruction set this CPU lacks: the C++ server exits 1 with one line naming
    it, before loading the compiled code."""
    flags = host_features()
    if flags is None:
        pytest.skip("no /proc/cpuinfo")
    lacking = sorted({"amx_tile", "avx512_fp16", "avx512f", "sve", "asimd", "xop"} - flags)[0]

    def needs(spec):
        spec["cpu"]["features"].append(lacking)
        return spec

    bad = _rewritten(served.work / "model.pt2", tmp_path / "lacking.pt2", needs)
    out = serve(served, bad, "", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 1 and "spec:" not in out.stdout
    assert out.stderr.count("\n") == 1 and f"this CPU lacks {lacking} (its /proc/cpuinfo flags)" in out.stderr, (
        out.stderr
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lacking.pt2"]


def test_cpp_names_raw_ids_and_lengths_over_a_features_limit(served, tmp_path):
    """A model with managed-collision features (raw ids) and a position-weighted one (at most ``MAX_HISTORY`` ids a
    sample), as TorchScript: C++ answers a probe of seen raw ids as Python does, and words its refusals as the
    artifact's own check: a raw id outside the collision module's id space, a sample with too many ids."""
    from tests import test_serving_collisions as zch

    with in_this_process(tmp_path):
        trainer = zch._trainer(1, steps=2)
        trainer.fit(zch.ZchModel(), DataLoader(zch.training_batches(0)[:2], batch_size=None, collate_fn=lambda b: b))
        trainer.save_checkpoint(tmp_path / "ckpt")
    spec = export_inference(tmp_path / "ckpt", tmp_path / "zch.pt", table_dtype="fp32")
    assert spec.raw_id_features == ["item", "user"] and spec.max_lengths == {"history": zch.MAX_HISTORY}
    batch = zch.probe(zch.slots(zch.ZchModel.load_from_checkpoint(tmp_path / "ckpt")))
    dense, values, lengths = serving_inputs(spec, batch["sparse"], batch["dense"])
    B, limit = dense.shape[0], zch.MAX_HISTORY
    one = torch.ones(3, dtype=torch.long)
    lines = [
        request(dense, values, lengths),
        request(dense[:1], torch.tensor([zch.HASH_SIZE, 0, 0]), one),
        request(dense[:1], torch.zeros(limit + 3, dtype=torch.long), torch.tensor([1, 1, limit + 1])),
    ]
    out = serve(served, tmp_path / "zch.pt", "".join(lines))
    assert out.returncode == 0, out.stderr[-3000:]
    answers = [line for line in out.stdout.splitlines() if not line.startswith("spec: ")]
    assert B > 1 and torch.allclose(
        outputs(answers[0])[0], _python_answer(tmp_path / "zch.pt", (dense, values, lengths)), rtol=0, atol=1e-6
    )
    assert answers[1] == (
        f"error: feature 'user': raw id {zch.HASH_SIZE} is outside its managed-collision id space of {zch.HASH_SIZE} "
        f"ids (input_hash_size: raw ids run from 0 to {zch.HASH_SIZE - 1})"
    )
    assert answers[2].startswith(f"error: feature 'history': sample 0 has {limit + 1} ids, more than the {limit}")


# ---- `serve --follow DIR`: a publish directory (docs/fresh-models.md), its versions picked up while serving


def _float_tables(module) -> dict[str, torch.Tensor]:
    """The training module's tables by name (``...embedding_bags.<table>.weight``), float rows."""
    state = module.state_dict()
    return {k.split(".")[-2]: v for k, v in state.items() if ".embedding_bags." in k and k.endswith(".weight")}


def _point(root: Path, version: int) -> None:
    """``root/LATEST`` -> ``version``, replaced atomically (as the publisher writes it)."""
    (root / ".LATEST.tmp").write_text(json.dumps({"version": version}))
    os.replace(root / ".LATEST.tmp", root / LATEST_FILE)


def _publish(
    root: Path, version: int, before, after, spec: InferenceSpec, point: bool = True, damage: bool = False
) -> Path:
    """Version ``version`` of the publish directory ``root`` as the design writes it (``lightning_rec.serving.deltas``):
    the rows of each table that differ between the modules ``before`` and ``after`` (in the package's bytes) and
    every dense tensor the package reads, one part, its manifest, the folder renamed into place; then LATEST."""
    old, new = _float_tables(before), _float_tables(after)
    tables = {}
    for name in spec.table_layout:
        ids = (old[name] != new[name]).any(dim=1).nonzero().flatten()
        tables[name] = (ids, artifact_rows(new[name][ids], spec.table_dtype))
    state = after.state_dict()
    dense = {key: state[key] for key in set(spec.constant_sources.values())}
    folder = version_dir(root, version)
    staging = folder.with_name(f".{folder.name}.tmp")
    staging.mkdir(parents=True)
    record = write_part(staging / "delta.r0.pt", tables, dense)
    manifest = Manifest(
        version, "delta", version - 1, version, None, 0, 1, spec.table_dtype, "", {"delta.r0.pt": record}
    )
    (staging / "manifest.json").write_text(manifest.to_json())
    if damage:  # one byte of the part's tensor data flipped after its checksum was recorded
        data = bytearray((staging / "delta.r0.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (staging / "delta.r0.pt").write_bytes(data)
    os.rename(staging, folder)
    if point:
        _point(root, version)
    return folder


@pytest.fixture(scope="module")
def published(served):
    """The fixture's fp32 package as version 1 of a publish directory, and the same DeepFM trained on in two more
    rounds of 2 steps (other rows of MovieLens): ``states[v - 1]`` is the plain module version ``v`` is."""
    case = ZooCase(**{**zoo_deepfm.CASE.__dict__, "build": _fast_deepfm})
    states, ckpt = [served.trained], served.work / "ckpt"
    more = case.batches(8)[4:]
    for round in (1, 2):
        module = type(served.trained).load_from_checkpoint(ckpt)
        with in_this_process(served.work):
            trainer = L.Trainer(strategy=RecShardStrategy(), accelerator="cpu", devices=1, max_steps=2, **QUIET_TRAINER)
            batches = more[2 * (round - 1) : 2 * round]
            trainer.fit(module, DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
            ckpt = served.work / f"ckpt{round + 1}"
            trainer.save_checkpoint(ckpt)
        states.append(type(served.trained).load_from_checkpoint(ckpt).eval())
    root = served.work / "published"
    (root / "full").mkdir(parents=True)
    shutil.copy(served.work / "model.pt2", full_path(root, 1))
    files = {full_path(root, 1).name: file_record(full_path(root, 1))}
    full = Manifest(1, "full", None, 4, None, 0, 1, served.spec.table_dtype, "", files)
    full_manifest_path(root, 1).write_text(full.to_json())
    _point(root, 1)
    assert served.spec.table_layout and served.spec.constant_sources, "the package records no table_layout"
    args = serving_inputs(served.spec, served.heldout.sparse_features, served.heldout.dense_features)
    return SimpleNamespace(root=root, states=states, spec=served.spec, args=args, line=request(*args))


def _expected(served, module) -> torch.Tensor:
    with torch.no_grad():
        return module.predict_step(copy.deepcopy(served.heldout), 0)["probability"].reshape(-1)


class _Follower:
    """``serve --follow DIR`` running, one request line at a time (stderr collected apart)."""

    def __init__(self, served, root: Path, tmp: Path, env: dict[str, str] | None = None):
        cmd = [str(served.work / "build" / "serve_cpp" / "serve"), "--follow", str(root), FBGEMM_GPU_DIR]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "TMPDIR": str(tmp), **(env or {})},
        )  # fmt: skip
        first = self.proc.stdout.readline()
        assert first.startswith("spec: "), first + self.proc.stderr.read()

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line if line.endswith("\n") else line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().rstrip("\n")

    def close(self) -> str:
        """Ends the input; the server's standard error."""
        _, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err
        return err


def _close(got: str, want: torch.Tensor) -> bool:
    (out,) = outputs(got)
    return out.shape == want.shape and torch.allclose(out, want, rtol=0, atol=1e-6)


def test_cpp_follows_a_publish_directory_and_applies_each_version_while_it_serves(served, published, tmp_path):
    """``serve --follow DIR`` serves the full package of version 1 as the trained module answers; version 2 (a
    delta: the rows 2 more steps changed, the dense weights), asked for with ``#refresh``, and version 3, found by
    the server itself (it watches LATEST) while requests go on, are each answered as the module of that training
    state answers (fp32 tables: to 1e-6), unlike the version before, and exactly as Python's
    :class:`~lightning_rec.serving.FreshModel` following the same directory answers; a server started at version 3
    starts from the full package and applies both deltas."""
    root = shutil.copytree(published.root, tmp_path / "published")
    states, spec, line = published.states, published.spec, published.line
    want = [_expected(served, m) for m in states]
    assert all((want[v] - want[v + 1]).abs().max() > 1e-3 for v in (0, 1)), "the versions must answer differently"
    server, python = _Follower(served, root, tmp_path), FreshModel(root)

    def same_as_python(answer: str) -> bool:
        with torch.inference_mode():
            return torch.equal(outputs(answer)[0], python(*published.args).reshape(-1))

    v1 = server.ask(line)
    assert server.ask("#version") == "version: 1" and _close(v1, want[0]) and same_as_python(v1)
    _publish(root, 2, states[0], states[1], spec)
    assert server.ask("#refresh") == "version: 2" and python.refresh() == 2
    v2 = server.ask(line)
    assert _close(v2, want[1]) and same_as_python(v2), (v2, want[1])
    _publish(root, 3, states[1], states[2], spec)
    start, answers = time.monotonic(), []
    while server.ask("#version") != "version: 3":  # requests go on until the server has found it
        answers.append(server.ask(line))
        assert time.monotonic() - start < 60, "version 3 was not picked up from LATEST within 60 s"
    v3 = server.ask(line)
    assert python.refresh() == 3 and same_as_python(v3)
    assert _close(v3, want[2]) and set(answers) <= {v2, v3}, (v3, want[2], set(answers))
    python.close()
    assert server.close() == ""
    later = _Follower(served, root, tmp_path)  # version 3 = full 1 + deltas 2 and 3, before it serves
    assert later.ask("#version") == "version: 3" and later.ask(line) == v3
    assert later.close() == "" and list(tmp_path.iterdir()) == [root]


def test_a_missing_or_damaged_delta_is_refused_by_name_and_the_last_good_version_serves(served, published, tmp_path):
    """LATEST moves to version 3 while its folder is missing, then to a version 3 whose part has one byte flipped:
    each is refused on standard error (naming the version and the file) and the server keeps answering version 2's
    answers; the same version written intact is then applied."""
    root = shutil.copytree(published.root, tmp_path / "published")
    states, spec, line = published.states, published.spec, published.line
    _publish(root, 2, states[0], states[1], spec)
    server = _Follower(served, root, tmp_path)
    v2 = server.ask(line)
    assert server.ask("#version") == "version: 2" and _close(v2, _expected(served, states[1]))
    folder = version_dir(root, 3)
    _point(root, 3)
    assert server.ask("#refresh") == "version: 2" and server.ask(line) == v2
    _publish(root, 3, states[1], states[2], spec, damage=True)
    assert server.ask("#refresh") == "version: 2" and server.ask(line) == v2
    shutil.rmtree(folder)
    _publish(root, 3, states[1], states[2], spec)
    assert server.ask("#refresh") == "version: 3" and _close(server.ask(line), _expected(served, states[2]))
    errors = server.close().splitlines()
    assert f"error: version 3 refused: {folder}/manifest.json is missing; serving version 2" in errors, errors
    damaged = [e for e in errors if f"{folder}/delta.r0.pt has SHA-256" in e]
    assert damaged and re.fullmatch(
        r"error: version 3 refused: \S+ has SHA-256 [0-9a-f]{16}\.\.\., its manifest records [0-9a-f]{16}\.\.\.: "
        r"it is damaged; serving version 2",
        damaged[0],
    ), errors


def test_requests_in_flight_while_a_version_is_applied_get_the_old_or_the_new_answers_never_a_mix(
    served, published, tmp_path
):
    """Requests sent back to back (one writer, the server never idle) while version 2 is published and picked up by
    the server's watcher, which takes 500 ms between writing a delta's tables and its dense weights (the server's
    test setting ``LIGHTNING_REC_SERVE_SLOW_APPLY_MS``: a server that wrote into the tensors in use would answer
    requests with new tables and old dense weights meanwhile): every answer is version 1's or version 2's, byte for
    byte, never a mix of the two; once the new one is given, the old one is not given again."""
    root = shutil.copytree(published.root, tmp_path / "published")
    server = _Follower(served, root, tmp_path, env={"LIGHTNING_REC_SERVE_SLOW_APPLY_MS": "500"})
    proc, line, stop = server.proc, published.line, threading.Event()

    def feed() -> None:
        while not stop.is_set():
            proc.stdin.write(line)
            proc.stdin.flush()
        proc.stdin.close()

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    answers, start = [proc.stdout.readline().rstrip("\n")], time.monotonic()
    _publish(root, 2, published.states[0], published.states[1], published.spec)  # while requests run
    for answer in proc.stdout:  # until the server ends: the writer closes its input once told to stop
        answers.append(answer.rstrip("\n"))
        if sum(a != answers[0] for a in answers) >= 50 or time.monotonic() - start > 60:
            stop.set()
    writer.join(timeout=60)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    old, new = answers[0], answers[-1]
    assert _close(old, _expected(served, published.states[0])) and _close(new, _expected(served, published.states[1]))
    switch = answers.index(new)
    assert set(answers[:switch]) == {old} and set(answers[switch:]) == {new}, sorted(set(answers) - {old, new})[:3]
    print(f"{switch} answers of version 1 (one before the publish), then {len(answers) - switch} of version 2")
