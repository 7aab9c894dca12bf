"""The C++ example (``examples/serve_cpp``) as the Serving page (``docs/serving.md``) builds and runs it: its bash block runs as
written (from a folder laid out like the repository root: the example, ``.venv``, the artifacts; only the package's
name differs, its tables being fp32), building once per module against the installed libtorch; the program then serves a trained DeepFM's held-out samples from
the TorchScript artifact and from the ``.pt2`` package as Python does (the fp32 package: the trained module's
``predict`` probabilities to 1e-6), and refuses a package compiled under another torch. ``examples/serve.py``
serves the package in a process without lightning_rec or torchrec. The same build's ``hash_ids``
(``examples/serve_cpp/hash_ids.h``) hashes raw ids to the rows Python's request encoding gives them."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import fbgemm_gpu
import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_rec import RecShardStrategy
from lightning_rec.config import EmbeddingOptimizer
from lightning_rec.models import DeepFMModule
from lightning_rec.serving import (
    InferenceSpec,
    encode_request,
    export_inference,
    load_inference,
    load_pt2,
    serving_inputs,
)
from lightning_rec.serving.requests import raw_inputs_record
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers import zoo_deepfm
from tests.helpers.data import REPO
from tests.helpers.serving import serve_fresh
from tests.helpers.zoo import ZooCase, seeded_module

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
    # This fixture runs before conftest's per-test isolation: give back the environment (Lightning leaves
    # MASTER_PORT in it, and its process group holding that port) and keep the run out of the checkout.
    saved, cwd = dict(os.environ), os.getcwd()
    try:
        os.chdir(work)
        trainer = L.Trainer(strategy=RecShardStrategy(), accelerator="cpu", devices=1, max_steps=4, **QUIET_TRAINER)
        trainer.fit(module, DataLoader(case.batches(4), batch_size=None, collate_fn=lambda b: b))
        trainer.save_checkpoint(work / "ckpt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)
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


def serve(served, artifact: str | Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(served.work / "build" / "serve_cpp" / "serve"), str(artifact), FBGEMM_GPU_DIR, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=served.work)


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
    lines = [dense.reshape(-1).tolist(), lengths.tolist(), values.tolist()]
    (tmp_path / "inputs.txt").write_text("".join(" ".join(repr(v) for v in line) + "\n" for line in lines))
    out = serve(served, served.work / name, str(rows), str(dense.shape[1]), str(features), str(tmp_path / "inputs.txt"))
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
            dst.writestr(info, data)
    out = serve(served, bad, "2", "2", str(len(served.spec.features)))
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
