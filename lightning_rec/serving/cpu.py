"""What a ``.pt2`` package's compiled code needs of the CPU that runs it, chosen at export and checked by every loader.

AOTInductor compiles for the exporting machine by default (``-march=native``: AVX-512, AMX where that CPU has them),
and a CPU without those instructions dies of ``SIGILL`` mid-request; torch's Python loader only logs a warning and
C++'s checks nothing. Export therefore compiles for a declared target:

- ``"portable"`` (the default): on x86-64, the ``x86-64-v3`` level (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE: every
  x86-64 server CPU since Intel Haswell, 2013, and AMD Excavator/Zen) with AVX2 kernels; elsewhere (no portable level
  defined here) as ``"native"``;
- ``"native"``: the exporting CPU, recorded as the instruction-set flags it has (``/proc/cpuinfo``).

The spec's ``cpu`` record holds the machine, the target and the flags (named as Linux's ``/proc/cpuinfo`` names them);
:func:`check_cpu` refuses, in one line, a CPU that lacks any. TorchScript artifacts hold no compiled code (FBGEMM
picks its kernels at run time): their spec's ``cpu`` is ``None``.

The compiled kernels are also independent of the exporting process's thread count: AOTInductor otherwise plans each
parallel loop for ``torch.get_num_threads()`` and writes ``num_threads(N)`` into the code (serial code from an export
under one thread). :func:`compile_options` asks for OpenMP's run-time thread count instead and plans loops for a
fixed count.
"""

from __future__ import annotations

import contextlib
import logging
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from lightning_rec.errors import ServingError

__all__ = ["CpuTarget", "check_cpu", "compile_options", "host_features", "quiet_isa_mismatch"]

CpuTarget = Literal["portable", "native"]

# x86-64-v3 (GCC/Clang -march=x86-64-v3) as /proc/cpuinfo names its flags: v2's cx16, lahf_lm, popcnt, pni (SSE3),
# ssse3, sse4_1, sse4_2; v3's avx, avx2, bmi1, bmi2, f16c, fma, abm (LZCNT), movbe, xsave.
_X86_64_V3 = (
    "abm", "avx", "avx2", "bmi1", "bmi2", "cx16", "f16c", "fma", "lahf_lm", "movbe", "pni", "popcnt", "sse4_1",
    "sse4_2", "ssse3", "xsave",
)  # fmt: skip

# The instruction-set flags a compiler may use under -march=native (a native package requires those its CPU has).
_ISA_FLAGS = frozenset(
    (
        *_X86_64_V3, "adx", "aes", "amx_bf16", "amx_fp16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_bitalg",
        "avx512_fp16", "avx512_vbmi2", "avx512_vnni", "avx512_vp2intersect", "avx512_vpopcntdq", "avx512bw",
        "avx512cd", "avx512dq", "avx512f", "avx512ifma", "avx512vbmi", "avx512vl", "avx_vnni", "clflushopt", "clwb",
        "fma4", "gfni", "movdir64b", "movdiri", "pclmulqdq", "rdrnd", "rdseed", "serialize", "sha_ni", "sse4a",
        "tbm", "vaes", "vpclmulqdq", "waitpkg", "xop", "xsavec", "xsaveopt",
        # aarch64's names
        "asimd", "asimddp", "asimdhp", "bf16", "i8mm", "sve", "sve2", "fphp", "atomics",
    )
)  # fmt: skip

# The number of threads AOTInductor plans each parallel loop's split for (a constant, so that the code does not
# depend on the exporting process); how many threads run is OpenMP's choice at run time (cpp.dynamic_threads).
_PLANNED_THREADS = 16


def host_features() -> frozenset[str] | None:
    """This CPU's instruction-set flags as ``/proc/cpuinfo`` names them (``None`` where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, aarch64
            return frozenset(value.split())
    return frozenset()


def compile_options(cpu: CpuTarget) -> tuple[dict[str, Any], dict[str, Any]]:
    """AOTInductor's settings for ``cpu`` and the spec's ``cpu`` record (``machine``, ``target``, ``features``).

    Example::

        >>> options, record = compile_options("portable")
        >>> options["cpp.march"], record["target"], "avx2" in record["features"]   # on an x86-64 machine
        ('x86-64-v3', 'x86-64-v3', True)
    """
    if cpu not in ("portable", "native"):
        raise ValueError(f"cpu must be 'portable' or 'native', got {cpu!r}.")
    threads: dict[str, Any] = {"cpp.dynamic_threads": True, "cpp.threads": _PLANNED_THREADS}
    machine = platform.machine()
    if cpu == "portable" and machine in ("x86_64", "AMD64"):
        # cpp.march replaces -march=native; cpp.simdlen 256 picks AVX2 kernels (else the best this CPU has)
        options = {**threads, "cpp.march": "x86-64-v3", "cpp.simdlen": 256}
        return options, {"machine": machine, "target": "x86-64-v3", "features": sorted(_X86_64_V3)}
    flags = host_features() or frozenset()
    return threads, {"machine": machine, "target": "native", "features": sorted(flags & _ISA_FLAGS)}


def check_cpu(record: dict[str, Any] | None, path: str | Path) -> None:
    """Refuse (``ServingError``, one line) to run the package at ``path`` on a CPU that lacks what its compiled code
    uses (``record``: its spec's ``cpu``; ``None``: nothing recorded, no check)."""
    if not record:
        return
    machine = platform.machine()
    if record.get("machine") not in (None, machine):
        raise ServingError(
            f"{str(path)!r} was compiled for {record['machine']} CPUs and this machine is {machine}. HINT: export it "
            "again on this kind of machine."
        )
    flags = host_features()
    if flags is None:  # no /proc/cpuinfo: torch's own view of the vector unit is all there is
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
        flags = frozenset({"AVX2": ("avx2",), "AVX512": ("avx2", "avx512f")}.get(capability, ()))
        if not any(f in flags for f in record.get("features", [])):
            return  # nothing known either way
    missing = [f for f in record.get("features", []) if f not in flags]
    if missing:
        raise ServingError(
            f"{str(path)!r} was compiled for {record.get('target')} CPUs, and this CPU lacks {', '.join(missing)} "
            "(its /proc/cpuinfo flags): it would stop on an illegal instruction. HINT: export it with the default "
            "`--cpu portable` (x86-64-v3), or on a machine like this one."
        )


class _IsaMismatch(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Device information mismatch for AOTI_CPU_ISA" not in record.getMessage()


@contextlib.contextmanager
def quiet_isa_mismatch() -> Iterator[None]:
    """While in this context, drop torch's warning that a package's vector ISA is not this CPU's best (a portable
    package's AVX2 on an AVX-512 CPU runs as intended; :func:`check_cpu` has refused a CPU that lacks what it needs).
    The warning comes from torch's package loader's logger (torch 2.13: ``torch.export.pt2_archive._package``)."""
    logger = logging.getLogger("torch.export.pt2_archive._package")
    quiet = _IsaMismatch()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
