"""torch's private names recshard relies on (ShardedTensor and the dispatch-mode base class are imported by the
package's ``__init__``): the default store, a tensor's version counter, ``Tensor.to``'s argument parser,
AOTInductor's compiler search, its input checks (compiled into every package) and its C++ package loader."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def default_store() -> torch.distributed.Store | None:
    """The default process group's key-value store, or ``None`` without a process group. torch keeps it private
    (``_get_default_store``); :mod:`lightning_rec._strategy.faults` uses it so that a failing rank can tell the others why,
    without opening a second rendezvous."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def tensor_version(tensor: torch.Tensor) -> int:
    """How many times ``tensor`` (or a view of its storage) was changed in place: torch's autograd version counter,
    public in behaviour but underscore-named (``Tensor._version``). The input checks use it to notice a checked
    KJT changed in place inside ``forward``. An inference tensor (made under ``torch.inference_mode``, e.g. the batch
    ``trainer.predict`` copies to a GPU) keeps no counter: -2, which no recorded version equals."""
    return -2 if tensor.is_inference() else tensor._version


# torch: what `Tensor.to(*args, **kwargs)` was asked for (device, dtype, non_blocking, memory_format), parsed as torch
# parses it; the one parser of every `to` signature (device, dtype, other tensor, keywords) is private.
def parse_to(*args: Any, **kwargs: Any) -> tuple:
    """``(device, dtype, non_blocking, memory_format)`` of a ``Tensor.to`` call's arguments."""
    import torch

    return torch._C._nn._parse_to(*args, **kwargs)


def cpp_compiler() -> str | Exception:
    """The C++ compiler AOTInductor will call, or why there is none (its own search: ``CXX``, then ``g++``)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return get_cpp_compiler()
    except Exception as err:  # InvalidCxxCompiler, or a failed probe of the compiler
        return err


# torch: AOTInductor generates a check of every input's dtype, shape, strides and device in each package, but runs it
# only when the serving process sets AOTI_RUNTIME_CHECK_INPUTS=1 (read once by the generated code); a package then
# reads whatever memory a wrong tensor points at. No public option compiles the check in, so while a package is
# generated the private code generator (CppWrapperCpu.generate_input_output_runtime_checks) is wrapped: the generated
# gate returns true, each message names the input and the dtype it got.
_AOTI_GATE = "env_var_value != nullptr && env_var_value[0] != '0'"
_AOTI_DTYPE_NAMES = (
    "static const char* lightning_rec_dtype_name(int32_t code) {\n"
    "    switch (code) {\n"
    + "".join(
        f'        case {code}: return "{name}";\n'
        for code, name in (
            (0, "uint8"), (1, "int8"), (2, "int16"), (3, "int32"), (4, "int64"), (5, "float16"),
            (6, "float32"), (7, "float64"), (11, "bool"), (15, "bfloat16"),
        )
    )
    + '        default: return "another dtype";\n    }\n}'
)  # fmt: skip


def aoti_input_checks_class() -> Any:
    """The code generator :func:`aoti_input_checks` wraps (a test pins it to the installed torch)."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    if not callable(getattr(CppWrapperCpu, "generate_input_output_runtime_checks", None)):
        raise AttributeError(
            "torch's CppWrapperCpu has no generate_input_output_runtime_checks: lightning_rec._compat must follow it"
        )
    return CppWrapperCpu


@contextlib.contextmanager
def aoti_input_checks(names: Sequence[str]) -> Iterator[None]:
    """While in this context, AOTInductor compiles packages that always check their inputs (dtype, static sizes and
    strides, the bounds of dynamic sizes, device) and raise ``std::runtime_error`` naming the input (``names``, in the
    package's argument order) and, for a dtype, the one it got; without it they check only under
    ``AOTI_RUNTIME_CHECK_INPUTS=1``. Raises ``RuntimeError`` if the generated code no longer has the gate (the
    package would not check)."""
    import re

    cls = aoti_input_checks_class()
    original = cls.generate_input_output_runtime_checks
    gated: list[bool] = []

    def generate(self: Any) -> None:
        original(self)
        buffer = getattr(self.prefix, "aot", self.prefix)  # a dual (JIT + AOT) buffer keeps the AOT lines apart
        lines = buffer._lines
        for i, line in enumerate(lines):
            if not isinstance(line, str):
                continue
            if _AOTI_GATE in line:
                line = line.replace(_AOTI_GATE, "true")
                gated.append(True)
            line = re.sub(
                r'"input_handles\[(\d+)\]: ',
                lambda m: f'"lightning_rec: input {m[1]} ({_input_name(names, int(m[1]))}): ',
                line,
            )
            line = re.sub(
                r'<< "but got: " << (\w+_dtype) << "\\n";',
                r'<< "but got: " << \1 << "(" << lightning_rec_dtype_name(\1) << ")\\n";',
                line,
            )
            lines[i] = line
        first = next(
            (i for i, line in enumerate(lines) if isinstance(line, str) and "static void check_input_0(" in line), 0
        )
        lines[first:first] = _AOTI_DTYPE_NAMES.splitlines()

    cls.generate_input_output_runtime_checks = generate
    try:
        yield
    finally:
        cls.generate_input_output_runtime_checks = original
    if not gated:
        raise RuntimeError(
            "lightning_rec: AOTInductor generated no AOTI_RUNTIME_CHECK_INPUTS gate to turn on: the package would not "
            "check its inputs (lightning_rec._compat.torch.aoti_input_checks must follow this torch)"
        )


def _input_name(names: Sequence[str], index: int) -> str:
    return names[index] if index < len(names) else f"input {index}"


# torch: AOTInductor's cache folder (where it writes the sources it compiles, whose paths end up in a package's
# generated sources) is named only by a private runtime helper.
def inductor_cache_dir() -> str:
    """The folder AOTInductor compiles in (``TORCHINDUCTOR_CACHE_DIR``, else torch's default under the temp folder)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


# torch: `torch._inductor.aoti_load_package` compares the package's recorded vector ISA with this CPU's only to log a
# warning, and finding this CPU's (`get_device_information` -> `cpu_vec_isa.pick_vec_isa`) compiles and runs a test
# program per ISA with the C++ compiler (`cpp_builder`, which imports `torch.utils.cpp_extension` and so setuptools):
# 15-31 s in a fresh inductor cache on this 2-core machine, a compiler and setuptools required to serve. The C++
# loader it then builds (`torch._C._aoti.AOTIModelPackageLoader`, what C++'s `AOTIModelPackageLoader` is) needs
# neither; lightning_rec checks the CPU itself (serving.cpu.check_cpu). The loader unpacks the package into a new
# `aotinductor_XXXXXX` folder under `TMPDIR` (c10's temp-dir helper) and removes it only when it is destroyed, so a
# process that dies while serving leaves the whole unpacked package behind.
def aoti_package_loader(path: str, tmpdir: str) -> Any:
    """Load the ``.pt2`` package at ``path`` with torch's C++ package loader (no compiler run, no setuptools), unpacked
    under ``tmpdir`` (``TMPDIR`` is pointed there while the loader is built: the caller holds a lock, and removes
    ``tmpdir`` once it returns: the library is mapped and the tables are read by then).

    Returns:
        the loader: ``boxed_run(list_of_tensors) -> list_of_tensors``, ``get_call_spec()``, ``get_metadata()``.
    """
    import os

    import torch

    loader_class = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if loader_class is None:
        raise AttributeError("torch._C._aoti.AOTIModelPackageLoader is gone: lightning_rec._compat must follow torch")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = tmpdir
    try:
        # (path, model name, run single-threaded, runners, device index): aoti_load_package's defaults
        return loader_class(path, "model", False, 1, -1)
    finally:
        if before is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = before
