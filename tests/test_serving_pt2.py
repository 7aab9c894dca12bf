"""Serving on ``torch.export`` + AOTInductor (``export_inference(..., format="pt2")``, ``lightning-rec export
--format pt2``): every zoo model's package, loaded back with :func:`load_pt2`, gives the trained module's outputs to
1e-6 with fp32 tables (``predict``'s probabilities for the CTR models), at the held-out batch and at other batch
sizes; int8/int4 packages equal the TorchScript artifacts of the same dtype (which ``test_serving.py`` ties to the
tables' signal) and stay within the same bounds; a user's script-style model exports from the shell; the package
holds its spec and versions (checked at load), keeps its tables out of the compiled code, checks its inputs (named
host-side, and in the graph itself), and nothing is written without a compiler or when the package does not match
the eager model. The C++ loader is in ``test_serving_cpp.py``. Each package compiles in 7-30 s: they are shared."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.export.pt2_archive import PT2ArchiveReader, PT2ArchiveWriter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec._cli import run
from lightning_rec.errors import ExportError, ServingError
from lightning_rec.serving import (
    export_inference,
    inference_spec,
    load_inference,
    load_pt2,
    pt2_spec,
    serving_inputs,
    verify,
)
from lightning_rec.serving.cpu import check_cpu, compile_options, host_features
from lightning_rec.serving.integrity import ARTIFACT_VERSION, MANIFEST_RECORD, seal
from lightning_rec.serving.network import network_features
from lightning_rec.serving.pt2 import SPEC_RECORD, stack_versions
from tests.helpers import zoo_deepfm, zoo_dlrm, zoo_sequential, zoo_two_tower
from tests.helpers.zoo_packages import zoo_checkpoint, zoo_package
from tests.test_serving import (
    _BOUND,
    _SIGNAL,
    MODELS,
    TutorialModel,
    _eager,
    _with_tables,
    trained_checkpoint,
    tutorial_batch,
)

# name -> (case, the module to build (default: the case's), the part it serves, training steps)
ZOO: dict[str, Any] = {
    "dlrm": (zoo_dlrm.CASE, MODELS["dlrm"][1], None, 4),
    "dcnv2": (zoo_dlrm.CASE, MODELS["dcnv2"][1], None, 4),
    "deepfm": (zoo_deepfm.CASE, MODELS["deepfm"][1], None, 4),
    "query": (zoo_two_tower.CASE, None, "query", 2),
    "candidate": (zoo_two_tower.CASE, None, "candidate", 2),
    "sasrec": (zoo_sequential.CASE, None, None, 2),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """name -> (checkpoint, the loaded module in eval mode), each trained once (the two towers share one; the
    checkpoints of the session, tests/helpers/zoo_packages.py: tests/test_serving_inputs.py serves the same)."""
    cache: dict[Any, tuple[Path, Any]] = {}

    def get(name: str) -> tuple[Path, Any]:
        case, build, _, steps = ZOO[name]
        ckpt = zoo_checkpoint(case, build, steps, tmp_path_factory)
        if ckpt not in cache:
            module = (build or case.build)()
            cache[ckpt] = (ckpt, type(module).load_from_checkpoint(ckpt).eval())
        return cache[ckpt]

    return get


def _inputs(spec, name: str, batch: Any) -> tuple[torch.Tensor, ...]:
    part = ZOO[name][2]
    if name == "sasrec":
        return serving_inputs(spec, batch["features"])
    if part is not None:
        return serving_inputs(spec, batch[part])
    return serving_inputs(spec, batch.sparse_features, batch.dense_features)


def _expected(module: Any, name: str, batch: Any) -> torch.Tensor:
    """What training's module gives: ``predict_step``'s probabilities (CTR), else its serving network eagerly."""
    with torch.no_grad():
        if ZOO[name][0] in (zoo_dlrm.CASE, zoo_deepfm.CASE):
            return module.predict_step(batch, 0)["probability"]
        if name == "sasrec":
            return module.inference_module()(batch["features"])
        return _eager(module, batch, ZOO[name][2])


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_zoo_model_serves_from_a_pt2_package_like_training(trained, name):
    """fp32 tables: the package's outputs on real held-out samples equal the trained module's to 1e-6, at the
    held-out batch and at batch sizes 1 and 64 (its batch dimension is dynamic); the spec in the zip is what export
    returned, with the versions that wrote it."""
    ckpt, module = trained(name)
    case, _, part, _ = ZOO[name]
    path, spec = zoo_package(ckpt, part)  # export_inference(ckpt, path, table_dtype="fp32", part=part), once a session
    assert spec.format == "pt2" and pt2_spec(path) == spec
    assert spec.versions == stack_versions()
    model = load_pt2(path)
    heldout = case.heldout()
    got, want = model(*_inputs(spec, name, heldout)), _expected(module, name, heldout)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    for rows in (1, 64):  # other batch sizes: the eager serving network on the same plain tensors
        args = _synthetic(spec, rows, seed=rows)
        with torch.no_grad():
            eager = _eager_on_tensors(module.inference_module(part), spec, args)
        got = model(*args)
        assert got.shape[0] == rows and torch.allclose(got, eager, rtol=0, atol=1e-6), (got - eager).abs().max()


def _synthetic(spec, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``rows`` samples of 0-3 ids per feature over each feature's whole table, as the package takes them."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(spec.features) * rows,), generator=g, dtype=torch.int32)
    limit = torch.tensor(spec.feature_rows).repeat_interleave(rows).repeat_interleave(lengths.long())
    values = (torch.rand(int(lengths.sum()), generator=g) * limit).long()
    dense = (torch.randn(rows, spec.num_dense_features, generator=g),) if spec.num_dense_features else ()
    weights = (torch.rand(values.numel(), generator=g),) if spec.weighted else ()
    return (*dense, values, lengths, *weights)


def _eager_on_tensors(net: torch.nn.Module, spec, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``net`` on the artifact's arguments; the features of its collections the artifact does not take (SASRec's
    target, negatives, catalog) empty."""
    dense, (values, lengths, *weights) = args[: bool(spec.num_dense_features)], args[bool(spec.num_dense_features) :]
    batch = lengths.numel() // len(spec.features)
    every = list(network_features(net)[0])
    per_feature = lengths.view(len(spec.features), batch)
    empty = lengths.new_zeros(batch)
    full = torch.cat([per_feature[spec.features.index(f)] if f in spec.features else empty for f in every])
    kjt = KeyedJaggedTensor(keys=every, values=values, lengths=full, weights=(weights or [None])[0])
    return net(*dense, kjt)


@pytest.mark.dist
def test_quantized_packages_equal_the_torchscript_artifacts_and_keep_the_tables_signal(tmp_path, trained):
    """int8 and int4 tables: the package gives the TorchScript artifact's outputs (the same FBGEMM kernels, to
    1e-6), and stays within ``test_serving``'s bound relative to what the tables contribute."""
    ckpt, module = trained("dlrm")
    heldout = zoo_dlrm.CASE.heldout()
    want = _expected(module, "dlrm", heldout)
    references = {fill: _eager(_with_tables(module, fill), heldout, None) for fill in ("zeros", "shuffled")}
    for dtype in ("int8", "int4"):
        spec = export_inference(ckpt, tmp_path / f"m_{dtype}.pt2", table_dtype=dtype)
        export_inference(ckpt, tmp_path / f"m_{dtype}.pt", table_dtype=dtype)
        args = _inputs(spec, "dlrm", heldout)
        got = load_pt2(tmp_path / f"m_{dtype}.pt2")(*args)
        with torch.no_grad():
            scripted = load_inference(tmp_path / f"m_{dtype}.pt")(*args)
        assert torch.allclose(got, scripted, rtol=0, atol=1e-6), (dtype, (got - scripted).abs().max())
        assert not torch.equal(got, want), "quantized tables should not be the float rows"
        error = (got - want).abs()
        for fill, reference in references.items():
            signal = (reference - want).abs()
            assert signal.mean() >= _SIGNAL
            ratio = max(float(error.max() / signal.max()), float(error.mean() / signal.mean()))
            assert ratio <= _BOUND[dtype], (dtype, fill, ratio)


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    """A tutorial-style user model (tables built on CPU with their own weights, dict batches, its own forward)
    trained for 2 steps, exported with fp32 tables through ``lightning-rec export --format pt2``, in a process
    running one intra-op thread (which AOTInductor would otherwise plan its loops for: see
    ``test_the_package_is_compiled_for_portable_cpus_and_any_thread_count``)."""
    work = tmp_path_factory.mktemp("tutorial")
    ckpt = trained_checkpoint(TutorialModel(), [tutorial_batch(i) for i in range(2)], work / "ckpt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(["export", str(ckpt), str(work / "model.pt2"), "--format", "pt2", "--table-dtype", "fp32"])
    finally:
        torch.set_num_threads(threads)
    return ckpt, work / "model.pt2"


@pytest.mark.dist
def test_a_users_model_exports_from_the_shell_and_keeps_its_tables_out_of_the_compiled_code(tutorial):
    """The CLI's package predicts what the checkpoint's model does (its dense width read through
    ``cat([relu(bottom(dense)), kt.values()])``, a table shared by two features); the tables' rows are in the
    package's weights blob, not in the compiled ``.so``."""
    ckpt, package = tutorial
    model = load_pt2(package)
    assert model.spec.num_dense_features == 3 and model.spec.features == ["user", "item", "seen"]
    trained = TutorialModel.load_from_checkpoint(ckpt).eval()
    batch = tutorial_batch(42)
    with torch.no_grad():
        want = trained(batch["dense"], batch["sparse"])
    got = model(*serving_inputs(model.spec, batch["sparse"], batch["dense"]))
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    reader = PT2ArchiveReader(str(package))
    names = reader.get_file_names()
    table = trained.ebc.embedding_bags["t_item"].weight.detach().contiguous().numpy().tobytes()
    blobs = [n for n in names if n.endswith(".blob")]
    sos = [n for n in names if n.endswith(".so")]
    assert blobs and sos
    assert any(table in reader.read_bytes(n) for n in blobs), "the table's rows are not in the weights blob"
    assert not any(table in reader.read_bytes(n) for n in sos), "the table's rows are compiled into the .so"


def _rewritten(package: Path, target: Path, edit) -> Path:
    """A copy of ``package`` whose spec record is ``edit(spec_dict)``, with its manifest made again (a package
    exported as such: see ``test_a_modified_file_is_refused_by_name_before_it_loads`` for one modified after)."""
    reader = PT2ArchiveReader(str(package))
    writer = PT2ArchiveWriter(str(target))
    for name in reader.get_file_names():
        data = reader.read_bytes(name)
        if name == SPEC_RECORD:
            data = json.dumps(edit(json.loads(data))).encode()
        if not writer.has_record(name) and name != MANIFEST_RECORD:
            writer.write_bytes(name, data)
    writer.close()
    seal(target)
    return target


@pytest.mark.dist
def test_a_package_loads_only_under_the_versions_that_compiled_it(tmp_path, tutorial):
    """A package whose recorded torch (or FBGEMM) differs from this process's is refused before anything loads,
    naming both versions; a file that is not a package is named as such."""
    _, package = tutorial

    def other_torch(spec):
        spec["versions"]["torch"] = "2.12.0+cpu"
        return spec

    def other_fbgemm(spec):
        spec["versions"]["fbgemm_gpu"] = "1.7.0"
        return spec

    with pytest.raises(ServingError, match=r"compiled under torch 2\.12\.0\+cpu and this process has torch 2\.13"):
        load_pt2(_rewritten(package, tmp_path / "old_torch.pt2", other_torch))
    with pytest.raises(ServingError, match=r"fbgemm_gpu 1\.7\.0 and this process has fbgemm_gpu"):
        load_pt2(_rewritten(package, tmp_path / "old_fbgemm.pt2", other_fbgemm))
    (tmp_path / "junk.pt2").write_bytes(b"not a zip")
    with pytest.raises(ServingError, match=r"junk\.pt2' is not a serving artifact \(a zip archive\)"):
        load_pt2(tmp_path / "junk.pt2")
    assert load_pt2(_rewritten(package, tmp_path / "same.pt2", lambda spec: spec)).spec == pt2_spec(package)


@pytest.mark.dist
def test_the_package_checks_its_inputs_host_side_by_name_and_in_the_graph(tutorial):
    """``load_pt2`` names the feature, the id and the table's rows (as the TorchScript artifact does); with its host
    check off, the package's own in-graph checks still refuse the same inputs (fixed text: the graph cannot know
    the feature)."""
    _, package = tutorial
    checked, unchecked = load_pt2(package), load_pt2(package, check_inputs=False)
    dense, lengths = torch.zeros(1, 3), torch.tensor([1, 1, 1], dtype=torch.int32)
    good = torch.tensor([29, 0, 49])
    assert torch.equal(checked(dense, good, lengths), unchecked(dense, good, lengths))
    cases = [
        (torch.tensor([30, 0, 0]), lengths, r"feature 'user': id 30 is outside its table of 30 rows", "outside"),
        (torch.tensor([0, 0, -1]), lengths, r"feature 'seen': id -1 is outside its table of 50 rows", "outside"),
        (good, torch.tensor([1, 2, 1], dtype=torch.int32), r"lengths add up to 4 ids, but values holds 3", "add up"),
        (good, torch.tensor([2, -1, 2], dtype=torch.int32), r"lengths holds a negative length", "negative"),
    ]
    for values, lens, named, graph in cases:
        with pytest.raises(ValueError, match=named):
            checked(dense, values, lens)
        with pytest.raises(RuntimeError, match=graph):
            unchecked(dense, values, lens)
    with pytest.raises(ValueError, match=r"lengths has 4 entries; the artifact reads 3 features"):
        checked(dense, good, torch.tensor([1, 1, 1, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"dense_features has shape \[2, 3\]; .* expects \[1, 3\]"):
        checked(torch.zeros(2, 3), good, lengths)


def test_without_a_compiler_pt2_export_names_what_to_install_and_writes_nothing(tmp_path):
    """No C++ compiler: refused before the checkpoint is read, naming what to install; the output is untouched."""
    (tmp_path / "model.pt2").write_bytes(b"the user's file")
    no_compiler = torch._inductor.config.patch({"cpp.cxx": (None, str(tmp_path / "no-such-g++"))})
    with no_compiler, pytest.raises(ExportError, match=r"C\+\+ compiler .*none was found.*apt install g\+\+"):
        export_inference(tmp_path / "no-checkpoint-needed", tmp_path / "model.pt2")
    assert (tmp_path / "model.pt2").read_bytes() == b"the user's file"
    with pytest.raises(ExportError, match=r"must end in \.pt2"):
        export_inference(tmp_path / "no-checkpoint-needed", tmp_path / "model.pt", format="pt2")


@pytest.mark.dist
def test_a_package_that_does_not_match_the_eager_model_is_not_written(tmp_path, tutorial, monkeypatch):
    """The round-trip check (load the package back, compare with eager) guards the rename: a package whose outputs
    differ raises ``ExportError`` and the file already there is kept, with no partial file left."""
    ckpt, _ = tutorial
    loader = torch._inductor.aoti_load_package

    class OffByOne:
        """The real package (its ``loader`` too, which the layout check reads), each output one off."""

        def __init__(self, runner):
            self.runner, self.loader = runner, runner.loader

        def __call__(self, *inputs):
            return self.runner(*inputs) + 1

    def off_by_one(path, *args, **kwargs):
        return OffByOne(loader(path, *args, **kwargs))

    monkeypatch.setattr(torch._inductor, "aoti_load_package", off_by_one)
    shutil.copy(tutorial[1], tmp_path / "model.pt2")
    before = (tmp_path / "model.pt2").read_bytes()
    with pytest.raises(ExportError, match="does not give the eager model's outputs"):
        export_inference(ckpt, tmp_path / "model.pt2", table_dtype="fp32")
    assert (tmp_path / "model.pt2").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt2"]


class BranchingModel(TutorialModel):
    """A forward that branches on a tensor value: it trains, but no graph can be captured from it."""

    def forward(self, dense, kjt):
        out = super().forward(dense, kjt)
        if out.sum() > 0:  # data-dependent Python control flow
            return out
        return -out


@pytest.mark.dist
def test_a_model_export_cannot_capture_is_named_and_nothing_is_written(tmp_path):
    """``torch.export`` refuses a forward that branches on tensor values: ``ExportError`` names the model, the
    construct and the way out, and no file appears."""
    ckpt = trained_checkpoint(BranchingModel(), [tutorial_batch(i) for i in range(2)], tmp_path / "ckpt")
    with pytest.raises(ExportError, match=r"BranchingModel cannot be captured by torch\.export: .*\.item\(\)"):
        export_inference(ckpt, tmp_path / "model.pt2", table_dtype="fp32", num_dense_features=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _tampered(package: Path, target: Path, suffix: str, *, rewrite: bool) -> Path:
    """A copy of ``package`` with one byte of its record ending in ``suffix`` flipped (bit 4 of its middle byte):
    ``rewrite=False`` in the file's bytes (as a disk or a copy would: the zip's CRC-32 no longer matches);
    ``rewrite=True`` in the record, the archive written again around it (the CRC-32 matches the new bytes)."""
    with zipfile.ZipFile(package) as src:
        (info,) = [i for i in src.infolist() if i.filename.endswith(suffix)]
        if rewrite:
            with zipfile.ZipFile(target, "w") as dst:
                for entry in src.infolist():
                    data = bytearray(src.read(entry))
                    if entry is info:
                        data[len(data) // 2] ^= 0x10
                    dst.writestr(entry, bytes(data))
            return target
    data = bytearray(package.read_bytes())
    # the record's bytes start after its local header, whose extra field (torch pads it to align the data) is not
    # the central directory's
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_length + extra_length
    assert data[start : start + info.file_size] == zipfile.ZipFile(package).read(info)
    data[start + info.file_size // 2] ^= 0x10
    target.write_bytes(bytes(data))
    return target


@pytest.fixture(scope="module")
def tutorial_ts(tutorial):
    """The tutorial checkpoint as a TorchScript artifact (no compiler: seconds)."""
    ckpt, package = tutorial
    export_inference(ckpt, package.with_name("model.pt"), table_dtype="fp32")
    return package.with_name("model.pt")


@pytest.mark.dist
@pytest.mark.parametrize(
    ("artifact", "suffix"),
    [("pt2", ".so"), ("pt2", "_weights.blob"), ("pt2", "extra/lightning_rec.json"), ("pt", "data/0")],
)
@pytest.mark.parametrize("rewrite", [False, True], ids=["bytes", "record"])
def test_a_modified_file_is_refused_by_name_before_it_loads(tutorial, tutorial_ts, tmp_path, artifact, suffix, rewrite):
    """One flipped bit in the compiled library, in the tables' blob, in the spec or in a TorchScript tensor: every
    loader of ours (``verify``, ``load_pt2``/``load_inference``) refuses the file before loading any of it, naming
    the file and the record, within seconds (a flipped byte in the library made torch's own load spin). Flipped in
    the file's bytes, or in a record written again with a matching zip CRC-32 (which only the SHA-256 catches)."""
    source = tutorial[1] if artifact == "pt2" else tutorial_ts
    assert verify(source) == verify(source)  # the untouched file passes, and its content hash is stable
    bad = _tampered(source, tmp_path / f"bad.{artifact}", suffix, rewrite=rewrite)
    load = load_pt2 if artifact == "pt2" else load_inference
    for loader in (verify, load):
        start = time.perf_counter()
        with pytest.raises(
            ServingError,
            match=rf"'{re.escape(str(bad))}' (was modified after export|is damaged): its record '[^']*{re.escape(suffix)}'",
        ):
            loader(bad)
        assert time.perf_counter() - start < 30


@pytest.mark.dist
def test_a_record_added_or_removed_or_no_manifest_is_refused(tutorial, tmp_path):
    """A record the manifest does not list, a listed record that is gone, an artifact without a manifest (written
    before there was one, or by another tool) and a file that is not an archive: each refused by name."""
    package = tutorial[1]
    with zipfile.ZipFile(package) as src:
        root = src.namelist()[0].split("/")[0]
        entries = [(e, src.read(e)) for e in src.infolist()]

    def rebuilt(name: str, keep, extra: dict[str, bytes]) -> Path:
        with zipfile.ZipFile(tmp_path / name, "w") as dst:
            for entry, data in entries:
                if keep(entry.filename):
                    dst.writestr(entry, data)
            for record, data in extra.items():
                dst.writestr(f"{root}/{record}", data)
        return tmp_path / name

    added = rebuilt("added.pt2", lambda n: True, {"extra/other.json": b"{}"})
    with pytest.raises(ServingError, match=r"holds a record 'extra/other.json' its manifest does not list"):
        load_pt2(added)
    gone = rebuilt("gone.pt2", lambda n: not n.endswith("custom_obj_0"), {})
    with pytest.raises(ServingError, match=r"its record 'data/constants/custom_obj_0' is missing"):
        load_pt2(gone)
    unsealed = rebuilt("unsealed.pt2", lambda n: not n.endswith(MANIFEST_RECORD), {})
    with pytest.raises(ServingError, match=r"carries no content hash \(extra/lightning_rec\.sha256\)"):
        verify(unsealed)
    assert load_pt2(unsealed, verify=False).spec == pt2_spec(package)  # the caller's explicit choice
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    with pytest.raises(ServingError, match=r"'.*junk\.pt' is not a serving artifact"):
        load_inference(tmp_path / "junk.pt")


@pytest.mark.dist
def test_the_package_is_compiled_for_portable_cpus_and_any_thread_count(tutorial):
    """The package exported by a process running one thread: compiled for x86-64-v3 (no -march=native, no AVX-512
    instruction in its library), which its spec declares; its parallel loops are OpenMP regions whose thread count
    is decided when they run (no ``num_threads(N)``, and not left serial)."""
    spec = pt2_spec(tutorial[1])
    if platform.machine() != "x86_64":
        pytest.skip("the portable target is defined for x86-64")
    assert spec.cpu == {
        "machine": "x86_64",
        "target": "x86-64-v3",
        "features": compile_options("portable")[1]["features"],
    }
    assert {"avx2", "fma", "f16c"} <= set(spec.cpu["features"]) and not any("avx512" in f for f in spec.cpu["features"])
    with zipfile.ZipFile(tutorial[1]) as package:
        sources = {n: package.read(n).decode() for n in package.namelist() if n.endswith(".cpp")}
        (library,) = [n for n in package.namelist() if n.endswith(".so")]
        so = package.read(library)
    code = "\n".join(sources.values())
    assert "march=x86-64-v3" in code and "march=native" not in code and "-mavx512" not in code
    assert code.count("#pragma omp parallel") >= 1 and "num_threads(" not in code
    if shutil.which("objdump"):
        (Path(tutorial[1]).parent / "lib.so").write_bytes(so)
        dump = subprocess.run(
            ["objdump", "-d", str(Path(tutorial[1]).parent / "lib.so")], capture_output=True, text=True
        )
        assert dump.returncode == 0 and "%zmm" not in dump.stdout and "%ymm" in dump.stdout


def test_compile_options_declare_what_they_compile_for():
    """``portable``: x86-64-v3 and AVX2 kernels, whatever this CPU has; ``native``: this CPU's instruction-set flags
    (a subset of /proc/cpuinfo's); both leave the thread count to OpenMP at run time."""
    portable, record = compile_options("portable")
    native, native_record = compile_options("native")
    for options in (portable, native):
        assert options["cpp.dynamic_threads"] is True and options["cpp.threads"] >= 1
    if platform.machine() == "x86_64":
        assert (
            portable["cpp.march"] == "x86-64-v3" and portable["cpp.simdlen"] == 256 and record["target"] == "x86-64-v3"
        )
    assert native_record["target"] == "native" and "cpp.march" not in native
    flags = host_features()
    if flags is not None:
        assert set(native_record["features"]) <= flags and native_record["features"]
    with pytest.raises(ExportError, match=r"cpu must be 'portable' or 'native', got 'avx512'"):
        export_inference("no-checkpoint-needed", "model.pt2", cpu="avx512")  # type: ignore[arg-type]
    with pytest.raises(ExportError, match=r"cpu='native' applies to --format pt2"):
        export_inference("no-checkpoint-needed", "model.pt", cpu="native")


@pytest.mark.dist
def test_a_cpu_without_the_packages_features_is_refused_in_one_line(tutorial, tmp_path):
    """A package whose spec requires an instruction set this CPU lacks (or another machine type) is refused by
    ``load_pt2`` in one line naming what is missing, before its code is loaded."""
    flags = host_features()
    if flags is None:
        pytest.skip("no /proc/cpuinfo")
    lacking = sorted({"amx_tile", "avx512_fp16", "avx512f", "sve", "asimd", "xop"} - flags)[0]

    def needs(feature=None, machine=None):
        def edit(spec):
            spec["cpu"] = {**spec["cpu"], "features": [*spec["cpu"]["features"], *([feature] if feature else [])]}
            if machine:
                spec["cpu"]["machine"] = machine
            return spec

        return edit

    with pytest.raises(
        ServingError, match=rf"compiled for x86-64-v3 CPUs, and this CPU lacks {lacking} \(its /proc/cpuinfo flags\)"
    ) as err:
        load_pt2(_rewritten(tutorial[1], tmp_path / "lacking.pt2", needs(lacking)))
    assert "\n" not in str(err.value)
    with pytest.raises(ServingError, match=r"compiled for riscv64 CPUs and this machine is"):
        load_pt2(_rewritten(tutorial[1], tmp_path / "riscv.pt2", needs(machine="riscv64")))
    check_cpu(None, "model.pt")  # TorchScript: nothing compiled, nothing to check


@pytest.mark.dist
def test_an_artifact_of_a_newer_layout_is_refused_by_name(tutorial, tmp_path):
    """A package whose spec says a layout version newer than this lightning_rec reads (with a field it does not
    know) is refused naming both versions, by ``pt2_spec`` and ``load_pt2``; this one's version is recorded."""
    assert pt2_spec(tutorial[1]).artifact_version == ARTIFACT_VERSION >= 1
    newer = _rewritten(tutorial[1], tmp_path / "newer.pt2", lambda s: {**s, "artifact_version": 99, "shards": 4})
    for read in (pt2_spec, load_pt2):
        with pytest.raises(
            ServingError,
            match=r"is an artifact of version 99, written by a newer lightning_rec; this one reads versions up to 1",
        ):
            read(newer)


def test_the_cli_takes_the_cpu_target_and_refuses_it_for_torchscript(capsys):
    """``lightning-rec export --cpu`` reaches ``export_inference``: ``native`` with ``--format torchscript`` (nothing
    compiled) is refused in one line before the checkpoint is read (exit 2); a target that is not one is refused by
    the parser."""
    with pytest.raises(SystemExit) as exit_:
        run(["export", "no-checkpoint-needed", "model.pt", "--format", "torchscript", "--cpu", "native"])
    assert exit_.value.code == 2
    assert "cpu='native' applies to --format pt2 (compiled code)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        run(["export", "no-checkpoint-needed", "model.pt2", "--format", "pt2", "--cpu", "avx512"])
    assert exit_.value.code == 2 and "invalid choice: 'avx512'" in capsys.readouterr().err


@pytest.mark.dist
def test_the_cli_and_python_name_the_torchscript_format_alike(tutorial, tmp_path, capsys):
    """``--format torchscript`` is the CLI's name for what Python calls ``format="torchscript"``, as ``--help`` says;
    ``inference``, the CLI's earlier name, still works on both sides: all four write the same TorchScript artifact
    (its spec says ``"torchscript"``, its predictions are the same)."""
    ckpt, _ = tutorial
    with pytest.raises(SystemExit) as exit_:
        run(["export", "--help"])
    assert exit_.value.code == 0
    usage = " ".join(capsys.readouterr().out.split())
    assert "--format {weights,torchscript,pt2}" in usage and "torchscript (alias: inference)" in usage
    written = []
    for name in ("torchscript", "inference"):
        run(["export", str(ckpt), str(tmp_path / f"cli_{name}.pt"), "--format", name, "--table-dtype", "fp32"])
        export_inference(ckpt, tmp_path / f"py_{name}.ts", format=name, table_dtype="fp32")
        written += [tmp_path / f"cli_{name}.pt", tmp_path / f"py_{name}.ts"]
    batch = tutorial_batch(7)
    outputs = []
    for path in written:
        spec = inference_spec(path)
        assert spec.format == "torchscript", path
        with torch.no_grad():
            outputs.append(load_inference(path)(*serving_inputs(spec, batch["sparse"], batch["dense"])))
    assert all(torch.equal(out, outputs[0]) for out in outputs)


def test_the_api_reference_says_torch_export_serves():
    """The API reference (the ``lightning_rec.serving`` modules' docstrings) names ``torch.export`` as a format that
    serves, not as one that refuses the quantized kernels (it did before TorchRec's fake classes)."""
    import importlib
    import pkgutil

    import lightning_rec.serving as serving

    names = [serving.__name__] + [f"{serving.__name__}.{m.name}" for m in pkgutil.iter_modules(serving.__path__)]
    for name in names:
        text = " ".join((importlib.import_module(name).__doc__ or "").split())
        assert not re.search(r"torch\.export`*\s+(refuses|is refused|cannot capture the quantized)", text), name
    assert "torch.export`` + AOTInductor" in " ".join((serving.__doc__ or "").split())


@pytest.mark.dist
def test_artifacts_do_not_embed_the_exporting_machines_paths(tutorial, tutorial_ts, tmp_path_factory):
    """Neither format carries the exporting machine's folders (working directory, home, temp directory, the
    checkpoint's folder, Python's and torch's install folders, the inductor cache) in any record: not in the spec,
    the compiled library (no line tables), the generated sources kept in a ``.pt2`` (placeholders), nor a TorchScript
    archive's source ranges (dropped). The one exception is the compiler's: the library's assertion messages name
    torch's headers and the generated sources by their absolute paths (``__FILE__``)."""
    import sys

    from lightning_rec._compat import inductor_cache_dir as cache_dir

    ckpt, package = tutorial
    folders = {
        Path.cwd(),
        Path.home(),
        Path(tempfile.gettempdir()),
        tmp_path_factory.getbasetemp(),
        ckpt.parent,
        Path(torch.__file__).parent,
        Path(sys.prefix),
        Path(cache_dir()),
    }
    needles = {str(form).encode() for f in folders for form in (f, f.resolve())}
    # What the compiler bakes into the library's assertion messages (__FILE__): torch's headers and the generated
    # sources' names, nothing else (docs/serving.md says so)
    baked = re.compile(
        rb"(%s)/include/[\w/.+-]+\.h(?=\x00)|(%s)/\w+/\w+\.(wrapper|kernel)\.cpp(?=\x00)"
        % (
            b"|".join(
                re.escape(str(p).encode()) for p in {Path(torch.__file__).parent, Path(torch.__file__).resolve().parent}
            ),
            b"|".join(re.escape(str(p).encode()) for p in {Path(cache_dir()), Path(cache_dir()).resolve()}),
        )
    )
    for artifact in (package, tutorial_ts):
        with zipfile.ZipFile(artifact) as archive:
            for name in archive.namelist():
                data = archive.read(name)
                if name.endswith(".so"):
                    data = baked.sub(b"", data)
                found = [needle for needle in needles if needle in data]
                assert not found, f"{artifact.name}: {name} holds {found}"
    # still artifacts that serve, alike
    batch = tutorial_batch(3)
    model = load_pt2(package)
    spec = inference_spec(tutorial_ts)
    with torch.no_grad():
        want = load_inference(tutorial_ts)(*serving_inputs(spec, batch["sparse"], batch["dense"]))
    got = model(*serving_inputs(model.spec, batch["sparse"], batch["dense"]))
    assert torch.allclose(got, want, rtol=0, atol=1e-6)


# A C++ compiler stand-in: logs each call, then runs the real compiler (so that a loader that compiles still works).
_RECORDER = """#!/bin/sh
echo "$0 $*" >> "{log}"
exec {real} "$@"
"""

# Loads the package in a fresh interpreter, calls it, reports what was unpacked and imported, then dies (SIGABRT).
_LOAD_AND_CRASH = """
import json, os, sys, time
import torch, fbgemm_gpu
from lightning_rec.serving import load_pt2
start = time.perf_counter()
model = load_pt2(sys.argv[1])
seconds = time.perf_counter() - start
model.warm_up()
print(json.dumps({"seconds": seconds, "setuptools": "setuptools" in sys.modules,
                  "unpacked": sorted(os.listdir(os.environ["TMPDIR"]))}), flush=True)
os.abort()
"""


@pytest.mark.dist
def test_a_cold_load_runs_no_compiler_imports_no_setuptools_and_a_crash_leaves_nothing_unpacked(tutorial, tmp_path):
    """``load_pt2`` in a fresh process with an empty inductor cache runs no C++ compiler (torch's own
    ``aoti_load_package`` compiles a test program per vector ISA to find this CPU's: 15-31 s here) and imports no
    setuptools; the package it unpacked is gone once it is loaded, so a process that then dies (SIGABRT) leaves
    nothing in the temp folder; the folder a process killed while loading left behind (its process id no longer
    runs) is removed by the next load."""
    _, package = tutorial
    bin_dir, tmp, cache = tmp_path / "bin", tmp_path / "tmp", tmp_path / "inductor-cache"
    for folder in (bin_dir, tmp, cache):
        folder.mkdir()
    log = tmp_path / "compiler-calls.log"
    real = shutil.which("g++") or "/usr/bin/g++"
    for name in ("g++", "c++", "gcc", "cc", "clang++", "clang"):
        (bin_dir / name).write_text(_RECORDER.format(log=log, real=real))
        (bin_dir / name).chmod(0o755)
    dead = subprocess.Popen(["true"])  # a process id that no longer runs
    dead.wait()
    abandoned = tmp / f"lightning_rec_pt2.{dead.pid}.x1y2"
    (abandoned / "data").mkdir(parents=True)
    (abandoned / "data" / "weights.blob").write_bytes(b"left by a killed load")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "CXX": str(bin_dir / "g++"),
        "TMPDIR": str(tmp),
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "PYTHONWARNINGS": "ignore",
    }
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_CRASH, str(package)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == -signal.SIGABRT, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert not log.exists(), f"a C++ compiler ran at load: {log.read_text()}"
    assert report["setuptools"] is False
    assert report["unpacked"] == [], "the unpacked package outlives the load"
    assert sorted(os.listdir(tmp)) == [], "the crashed process left files in the temp folder"


@pytest.mark.dist
def test_a_correct_request_is_checked_once_in_the_package_not_again_in_python(tutorial, monkeypatch):
    """The host-side check (which names the feature and the id) runs only when the package has refused a request:
    a correct one costs no Python check (the package's compiled checks run on every call, as TorchScript's do)."""
    import lightning_rec.serving.pt2 as pt2

    _, package = tutorial
    model = load_pt2(package)
    calls = []
    original = pt2.check_inputs
    monkeypatch.setattr(pt2, "check_inputs", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    dense, lengths = torch.zeros(2, 3), torch.tensor([1, 1, 1, 1, 1, 1])
    model(dense, torch.tensor([29, 0, 0, 1, 49, 0]), lengths)
    assert calls == []
    with pytest.raises(ValueError, match=r"feature 'user': id 30 is outside its table of 30 rows"):
        model(dense, torch.tensor([30, 0, 0, 1, 49, 0]), lengths)
    assert calls == [1]
    with pytest.raises(ValueError, match=r"the package takes \(dense_features, values, lengths\); got 2 tensors"):
        model(dense, torch.tensor([0]))
