"""``.pt2`` packages: the serving network captured by ``torch.export`` and compiled ahead of time by AOTInductor
(PyTorch's supported path since TorchScript's deprecation), loaded in Python by :func:`load_pt2` or by
:func:`torch._inductor.aoti_load_package`, and in C++ by ``torch::inductor::AOTIModelPackageLoader`` (libtorch
alone, after FBGEMM's operator libraries are ``dlopen``-ed; ``examples/serve_cpp``).

A package is a zip (PyTorch's PT2 archive) holding the compiled model (a ``.so`` of the dense layers and the calls
into FBGEMM's kernels), the tables beside it as a binary blob (``package_constants_on_disk_format="binary_blob"``:
they are not compiled into the ``.so``), and ``extra/lightning_rec.json``: the :class:`InferenceSpec` (feature
order, tables, dtype, inputs) with the exact torch, fbgemm_gpu and torchrec versions that wrote it. A package runs
only under the torch and FBGEMM that compiled it; :func:`load_pt2` checks that before loading anything.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_rec import _compat
from lightning_rec.errors import ExportError, ServingError
from lightning_rec.serving import layout
from lightning_rec.serving.artifact import InferenceSpec, as_ids, check_dense, check_inputs
from lightning_rec.serving.cpu import check_cpu, quiet_isa_mismatch
from lightning_rec.serving.integrity import check_version, seal
from lightning_rec.serving.integrity import verify as verify_file

__all__ = ["SPEC_RECORD", "Pt2Model", "check_compiler", "load_pt2", "pt2_spec", "stack_versions", "write_pt2"]

SPEC_RECORD = "extra/lightning_rec.json"  # a name under the archive's root folder, where PT2 keeps extra files

# Which versions a package must be loaded under (a compiled .so calls into their exact ABIs), and which are recorded.
_BINDING = ("torch", "fbgemm_gpu")
_RECORDED = ("torch", "fbgemm_gpu", "torchrec", "lightning_rec")

# The package's inputs: dense_features (when it reads them), values, lengths, weights (when weighted); packages
# written before the spec listed its inputs took int32 lengths.
_OLD_DTYPES = (torch.float32, torch.int64, torch.int32, torch.float32)

# The compiled graph keeps the tables out of the .so, in one blob beside it (TorchRec's tables are large).
_INDUCTOR_CONFIGS = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "binary_blob",
    # The input checks compiled in (see write_pt2) test a dynamic size against the range export inferred, whose lower
    # bound is 2 (torch specialises 0 and 1): a batch of one sample, or a request with no ids, is a correct input.
    "aot_inductor.check_lowerbound": False,
    # No line tables (-g1, on by default): their DWARF names this machine's torch, Python and inductor cache folders
    "aot_inductor.enable_line_tables": False,
    # Every tensor a constant, none compiled into the code (a tensor of up to 8 values would be): a published
    # version replaces them in place (see lightning_rec.serving.layout)
    "always_keep_tensor_constants": True,
}


def stack_versions() -> dict[str, str]:
    """The installed versions of what a package binds to (torch, fbgemm_gpu) and came from (torchrec, lightning_rec);
    a package not installed is left out.

    Example::

        >>> sorted(stack_versions())
        ['fbgemm_gpu', 'lightning_rec', 'torch', 'torchrec']
    """
    versions: dict[str, str] = {"torch": str(torch.__version__)}
    for name, dist in (
        ("fbgemm_gpu", "fbgemm-gpu-cpu"),
        ("fbgemm_gpu", "fbgemm-gpu"),
        ("torchrec", "torchrec"),
        ("lightning_rec", "lightning-rec"),
    ):
        if name not in versions:
            try:
                versions[name] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
    return {k: versions[k] for k in _RECORDED if k in versions}


def write_pt2(
    model: nn.Module,
    spec: InferenceSpec,
    output: Path,
    options: dict[str, Any] | None = None,
    training: Mapping[str, Tensor] | None = None,
) -> InferenceSpec:
    """Export ``model`` (plain tensors in: ``[dense_features,] values, lengths[, weights]``), compile it with
    AOTInductor (with ``options``: the CPU target's, :func:`~lightning_rec.serving.cpu.compile_options`), package it
    with ``spec`` and its manifest (:func:`~lightning_rec.serving.integrity.seal`), load the package back and compare
    it with ``model`` on a seeded random batch (:func:`_check_batch`), and only then move it to ``output`` (an
    existing file is replaced only then). Returns the spec written: ``spec`` with the tables' places in the
    package's constants (``table_layout``) and, given the training module's ``state_dict(keep_vars=True)``
    (``training``), the training tensor each other constant is (``constant_sources``): see
    :mod:`lightning_rec.serving.layout`.

    Raises:
        ExportError: no C++ compiler, a network ``torch.export`` cannot capture, or a package that does not give
            the eager model's outputs; nothing is written.
    """
    check_compiler()
    _register_fake_classes()
    _plain_buffers(model)
    layout.name_tables(model)
    try:
        exported = torch.export.export(
            model, _arguments(spec, _trace_inputs(spec)), dynamic_shapes=_dynamic_shapes(spec), strict=False
        )
    except Exception as err:  # export raises many types; the message names the construct
        raise ExportError(
            f"{spec.model}{f' ({spec.part})' if spec.part else ''} cannot be captured by torch.export: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. HINT: the served network must not "
            "branch on tensor values or read them as Python numbers (.item(), .tolist(), int(t)); or export "
            "--format torchscript."
        ) from err
    tables = layout.table_layout(model, spec.table_dtype)
    sources, fixed = layout.constant_sources(exported, training or {}, [t["constant"] for t in tables.values()])
    spec = dataclasses.replace(spec, table_layout=tables, constant_sources=sources, fixed_sources=fixed)
    with tempfile.TemporaryDirectory(prefix="lightning_rec_pt2_") as scratch:
        compiled = Path(scratch) / "compiled.pt2"
        configs = {
            **_INDUCTOR_CONFIGS,
            **(options or {}),
            "aot_inductor.metadata": {"lightning_rec": json.dumps(asdict(spec))},
        }
        # Every call checks its inputs' dtypes, static sizes (the dense width), strides and device in the compiled
        # code, whoever loads it (Python, C++), and raises naming the input; AOTInductor would check only under
        # AOTI_RUNTIME_CHECK_INPUTS=1 and otherwise read a wrong tensor's memory as the dtype and shape it expects.
        with _compat.aoti_input_checks([record["name"] for record in spec.inputs or []]):
            torch._inductor.aoti_compile_and_package(exported, package_path=str(compiled), inductor_configs=configs)
        # where each table's initial bytes lie in the package, for a server that keeps its own copy to update
        spec = dataclasses.replace(spec, table_layout=layout.locate_tables(compiled, tables, model))
        output.parent.mkdir(parents=True, exist_ok=True)
        # Written beside the output (a rename is atomic within one file system) under the output's own name: the
        # archive's root folder is named after the file.
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
        partial = staging / output.name
        try:
            _with_spec(compiled, partial, spec)
            seal(partial)
            _round_trip(partial, model, _check_batch(spec), spec)
            os.replace(partial, output)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return spec


def pt2_spec(path: str | Path) -> InferenceSpec:
    """The :class:`InferenceSpec` stored in the package at ``path`` (read from the zip; nothing is loaded)."""
    from torch.export.pt2_archive import PT2ArchiveReader

    try:
        reader = PT2ArchiveReader(str(path))
        names = reader.get_file_names()
    except Exception as err:
        raise ServingError(f"{str(path)!r} is not a .pt2 package: {type(err).__name__}: {err}") from None
    if SPEC_RECORD not in names:
        raise ServingError(
            f"{str(path)!r} is a .pt2 package without {SPEC_RECORD}: it was not written by lightning_rec's export "
            "(load it with torch._inductor.aoti_load_package)."
        )
    record = json.loads(reader.read_string(SPEC_RECORD))
    check_version(record, path)
    return InferenceSpec(**record)


class Pt2Model:
    """A loaded ``.pt2`` package, called like the TorchScript artifact: ``model([dense_features,] values, lengths[,
    weights])``. The package checks every request itself, before any kernel reads it (compiled in: see
    :func:`~lightning_rec.serving.artifact.assert_inputs`); a request it refuses is checked again here, in Python,
    to name what is wrong (the feature, the sample, the id, the table's rows), which the compiled checks cannot. A
    correct request is checked once, as in the TorchScript artifact: nothing runs in Python but the dtype conversion.

    The package is loaded by torch's C++ loader (no C++ compiler, no setuptools: see
    :func:`~lightning_rec._compat.torch.aoti_package_loader`), unpacked into a folder that is removed as soon as it is
    loaded (``_load_package``): a process that dies while serving leaves nothing in the temp folder.

    Args:
        path: the package.
        spec: its :class:`InferenceSpec`.
        check: name the problem of a refused request in Python (``ValueError``); ``False``: the package's own
            ``RuntimeError`` (a fixed text per check).
    """

    def __init__(self, path: str | Path, spec: InferenceSpec, check: bool = True) -> None:
        self.spec = spec
        self.check = check and spec.feature_rows is not None
        self._check_ids = spec.bounds_check == "error"  # the lengths and dense shapes under every policy
        self._rows = torch.tensor(spec.feature_rows or [], dtype=torch.long)
        self._raw_ids = [f in spec.raw_id_features for f in spec.features]
        no_limit = torch.iinfo(torch.long).max
        limits = [spec.max_lengths.get(f, no_limit) for f in spec.features]
        self._max_lengths = torch.tensor(limits, dtype=torch.long) if spec.max_lengths else None
        self._loader = _load_package(path)
        self._dtypes = self._input_dtypes()
        offset = 1 if spec.num_dense_features else 0
        self._ids = {offset: "values", offset + 1: "lengths"}  # argument position -> name

    def __call__(self, *args: Tensor | None) -> Tensor:
        # Any integer dtype and layout is taken here: the package itself takes only the dtypes its spec lists, dense
        # (contiguous) tensors, and refuses the others by name (packages written before it checked read them wrong).
        # A correct request (the spec's dtypes, contiguous) goes to the package as it is: a call costs a few
        # attribute reads here (benchmarks/serving_costs.py latency).
        given = [a for a in args if a is not None]
        if len(given) != len(self._dtypes):
            raise ValueError(f"the package takes ({self._signature()}); got {len(given)} tensors.")
        inputs = given
        if any(a.dtype != dtype or not a.is_contiguous() for a, dtype in zip(given, self._dtypes)):
            for i, name in self._ids.items():
                as_ids(given[i], name)  # a float id is refused, not rounded
            inputs = [a.to(dtype).contiguous() for a, dtype in zip(given, self._dtypes)]
        try:
            # the C++ runner itself (torch's Python wrapper parses the call spec's JSON again on every call); the
            # served network returns one tensor, and records no autograd graph
            return self._loader.boxed_run(inputs)[0]
        except RuntimeError:
            # The package's own checks (compiled in, ahead of every kernel) refused the request; the same checks in
            # Python name the feature, the sample and the id. They run only then: a served request is checked once,
            # as in the TorchScript artifact.
            if self.check:
                self._check(args)
            raise

    def warm_up(self) -> Tensor:
        """Call the package on the request its spec records and check the answer (see
        :func:`~lightning_rec.serving.warm_up`): a server's first call and health check."""
        from lightning_rec.serving.artifact import warm_up

        return warm_up(self, self.spec)

    def _input_dtypes(self) -> tuple[torch.dtype, ...]:
        if self.spec.inputs is not None:
            return tuple(getattr(torch, record["dtype"]) for record in self.spec.inputs)
        return _OLD_DTYPES[1:] if not self.spec.num_dense_features else _OLD_DTYPES

    def _signature(self) -> str:
        first = "dense_features, " if self.spec.num_dense_features else ""
        return f"{first}values, lengths{', weights' if self.spec.weighted else ''}"

    def _check(self, args: tuple[Tensor | None, ...]) -> None:
        spec = self.spec
        offset = 1 if spec.num_dense_features else 0
        if len(args) < offset + 2:
            raise ValueError(f"the package takes ({self._signature()}).")
        values, lengths = args[offset], args[offset + 1]
        assert values is not None and lengths is not None
        check_inputs(values, lengths, spec.features, self._rows, self._raw_ids, self._max_lengths, self._check_ids)
        if offset:
            if args[0] is None:
                raise ValueError("dense_features is None; the package reads dense features.")
            check_dense(args[0], lengths, len(spec.features), spec.num_dense_features)


# Each load unpacks into its own folder named after the process, so that a process killed while loading has its
# folder removed by the next load anywhere on this machine (as the C++ server does with lightning_rec_serve.<pid>).
_UNPACKED = "lightning_rec_pt2."
_LOADING = threading.Lock()  # TMPDIR is pointed at the folder while a loader is built


def _load_package(path: str | Path) -> Any:
    """torch's C++ loader of the ``.pt2`` package at ``path`` (``boxed_run(tensors) -> tensors``), unpacked into
    ``$TMPDIR/lightning_rec_pt2.<pid>.<random>``, which is removed as soon as the loader returns (Linux keeps a
    mapped library and an open file readable after their names are gone): a process that dies while serving, as
    one that returns, leaves nothing behind; one killed while loading leaves its folder, removed by the next load in
    any process (its process id no longer runs). Nothing is checked here: see :func:`load_pt2`."""
    root = Path(tempfile.gettempdir())
    _remove_abandoned(root)
    folder = tempfile.mkdtemp(prefix=f"{_UNPACKED}{os.getpid()}.", dir=root)
    try:
        with _LOADING:
            return _compat.aoti_package_loader(str(path), folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _remove_abandoned(root: Path) -> None:
    """Remove the unpacked folders (``_load_package``) of processes that no longer run."""
    for folder in root.glob(f"{_UNPACKED}*"):
        pid = folder.name[len(_UNPACKED) :].partition(".")[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # another user's live process
            pass


def load_pt2(path: str | Path, *, check_inputs: bool = True, verify: bool = True) -> Pt2Model:
    """Load a ``.pt2`` package written by ``export_inference(..., format="pt2")``, after checking that this torch and
    FBGEMM are the ones that compiled it (a mismatch is a :class:`~lightning_rec.errors.ServingError` naming both),
    that this CPU has what its compiled code uses (:func:`~lightning_rec.serving.cpu.check_cpu`, one line naming the
    missing flags) and that the file is the one export wrote (:func:`~lightning_rec.serving.verify`: each record's
    SHA-256, naming the record that differs; ``verify=False`` skips it).

    Example::

        model = load_pt2("model_int8.pt2")
        probabilities = model(*serving_inputs(model.spec, batch.sparse_features, batch.dense_features))
    """
    import fbgemm_gpu  # noqa: F401  (registers the operators and classes the compiled code calls)

    if verify:  # first: nothing in the file is trusted before (its spec included)
        verify_file(path)
    spec = pt2_spec(path)
    written = spec.versions or {}
    here = stack_versions()
    wrong = {k: (written.get(k), here.get(k)) for k in _BINDING if written.get(k) != here.get(k)}
    if wrong:
        raise ServingError(
            f"{str(path)!r} was compiled under "
            + ", ".join(f"{k} {w}" for k, (w, _) in wrong.items())
            + " and this process has "
            + ", ".join(f"{k} {h}" for k, (_, h) in wrong.items())
            + ": a .pt2 package runs only under the torch and FBGEMM that compiled it. HINT: export it again here "
            "(`lightning-rec export CKPT OUT --format pt2`), or serve the TorchScript artifact (--format torchscript)."
        )
    check_cpu(spec.cpu, path)
    return Pt2Model(path, spec, check_inputs)


def _trace_inputs(spec: InferenceSpec) -> tuple[Tensor | None, ...]:
    """Three samples with 0, 1 and 2 ids per feature (no size is 0 or 1, so none is specialised), ids all 0."""
    batch = 3
    lengths = torch.tensor([0, 1, 2] * len(spec.features), dtype=torch.long)
    n = int(lengths.sum())
    return (
        torch.zeros(batch, spec.num_dense_features),
        torch.zeros(n, dtype=torch.long),
        lengths,
        torch.ones(n) if spec.weighted else None,
    )


def check_compiler() -> None:
    """Refuse (``ExportError``, naming what to install) when AOTInductor would find no C++ compiler."""
    from lightning_rec import _compat

    compiler = _compat.cpp_compiler()
    if isinstance(compiler, Exception):
        raise ExportError(
            f"--format pt2 compiles the package with a C++ compiler (AOTInductor), and none was found: {compiler}. "
            "HINT: install one (Debian/Ubuntu: `apt install g++`; conda: `conda install -c conda-forge gxx`) or "
            "point the CXX environment variable at it; or export --format torchscript, which needs none."
        )


def _plain_buffers(model: nn.Module) -> None:
    """Replace tensor-subclass buffers by the plain tensors they wrap: TorchRec keeps int4/int2 rows as
    ``UInt4Tensor``/``UInt2Tensor`` views for its state dict (the kernels read their own packed copy), which
    AOTInductor cannot clone (``aten.as_strided``)."""
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            inner = getattr(buffer, "elem", None)
            if buffer is not None and type(buffer) is not torch.Tensor and isinstance(inner, torch.Tensor):
                setattr(module, name, inner)


@functools.cache
def _register_fake_classes() -> None:
    """FBGEMM's ``AtomicCounter``/``TensorQueue`` as fake classes (the quantized kernels hold them), as TorchRec's
    ``test_pt2`` does; once per process (a second registration warns)."""
    from torchrec.pt2.utils import register_fake_classes

    register_fake_classes()


def _check_batch(spec: InferenceSpec, batch: int = 5) -> tuple[Tensor | None, ...]:
    """``batch`` samples with 0 to 3 ids per feature, drawn over each feature's whole table (seeded)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (len(spec.features) * batch,), generator=g, dtype=torch.long)
    rows = torch.tensor(spec.feature_rows or [1] * len(spec.features)).repeat_interleave(batch)
    limit = rows.repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * limit).long()
    return (
        torch.randn(batch, spec.num_dense_features, generator=g),
        values,
        lengths,
        torch.rand(values.numel(), generator=g) if spec.weighted else None,
    )


def _arguments(spec: InferenceSpec, full: tuple[Tensor | None, ...]) -> tuple[Tensor, ...]:
    """The package's arguments out of ``(dense_features, values, lengths, weights)``: dense only if it reads dense
    features, weights only if it reads weights."""
    dense, values, lengths, weights = full
    assert values is not None and lengths is not None
    return (
        *((dense,) if spec.num_dense_features and dense is not None else ()),
        values,
        lengths,
        *((weights,) if spec.weighted and weights is not None else ()),
    )


def _dynamic_shapes(spec: InferenceSpec) -> tuple[dict[int, Any], ...]:
    """Any batch size, any number of ids, and ``lengths`` of a size of its own (in :func:`_arguments`' order): the
    compiled code trusts a size derived from another input's (features x batch) and would read past a shorter
    ``lengths``; its own size is checked against features x batch in the graph (:func:`assert_inputs`)."""
    batch = torch.export.Dim("batch", min=1, max=2**20)
    ids = torch.export.Dim("ids", min=1, max=2**31 - 2)
    # (export specialises a batch of 0 or 1, so a batch taken from lengths, F x B, starts at 2 x F; the compiled
    # checks leave lower bounds out: see _INDUCTOR_CONFIGS)
    lengths = torch.export.Dim("lengths", min=1 if spec.num_dense_features else 2 * len(spec.features), max=2**31 - 2)
    return (
        *(({0: batch},) if spec.num_dense_features else ()),
        {0: ids},
        {0: lengths},
        *(({0: ids},) if spec.weighted else ()),
    )


def _with_spec(compiled: Path, output: Path, spec: InferenceSpec) -> None:
    """Copy the compiled package's records into ``output`` with ``spec`` added (``SPEC_RECORD``)."""
    from torch.export.pt2_archive import PT2ArchiveReader, PT2ArchiveWriter

    reader = PT2ArchiveReader(str(compiled))
    writer = PT2ArchiveWriter(str(output))
    places = _machine_paths()
    try:
        for name in reader.get_file_names():  # names under the archive's root folder
            if not writer.has_record(name):
                data = reader.read_bytes(name)
                if name.endswith(".cpp"):  # the generated sources, kept for reading: no loader compiles them
                    for path, placeholder in places:
                        data = data.replace(path, placeholder)
                writer.write_bytes(name, data)
        writer.write_string(SPEC_RECORD, json.dumps(asdict(spec)))
    finally:
        writer.close()


def _machine_paths() -> list[tuple[bytes, bytes]]:
    """The exporting machine's folders that AOTInductor writes into the generated sources it packages (their
    compile commands, include paths and file names), longest first, each with the placeholder it becomes."""
    import sys

    named = [
        (_compat.inductor_cache_dir(), "<inductor-cache>"),
        (os.path.dirname(torch.__file__), "<torch>"),
        (sys.prefix, "<python>"),
        (sys.base_prefix, "<python>"),
        (os.getcwd(), "<cwd>"),
        (os.path.expanduser("~"), "<home>"),
        (tempfile.gettempdir(), "<tmp>"),
    ]
    pairs = {}
    for path, placeholder in named:
        for form in {path, os.path.realpath(path)}:
            if len(form) > 1:  # never "/"
                pairs[form.encode()] = placeholder.encode()
    return sorted(pairs.items(), key=lambda pair: -len(pair[0]))


def _round_trip(package: Path, model: nn.Module, check: tuple[Tensor | None, ...], spec: InferenceSpec) -> None:
    """Load ``package`` back and compare it with the eager ``model`` on ``check`` (``(dense_features, values,
    lengths, weights)``)."""
    args = _arguments(spec, check)
    try:
        with quiet_isa_mismatch():
            loaded = torch._inductor.aoti_load_package(str(package))
        constants = loaded.loader.get_constant_fqns()
        with torch.inference_mode():
            got, expected = loaded(*args), model(*args)
    except Exception as err:
        raise ExportError(
            f"the compiled package failed its round-trip check (load it back, call it): {type(err).__name__}: {err}"
        ) from err
    if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
        worst = float((got - expected).abs().max())
        raise ExportError(
            f"the compiled package does not give the eager model's outputs on the check batch (largest difference "
            f"{worst:.3g}); nothing was written."
        )
    layout.check_layout(constants, spec.table_layout or {}, spec.constant_sources or {})
