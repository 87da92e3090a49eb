"""Which vector instructions this package's CPU kernels may use: what the CPU has, narrowed
by `--cpu-isa` (the environment variable `MG_CPU_ISA`, which the flag sets).

The serving kernels are built from source at start-up for one instruction set: AMX
(`amx_matmul`), AVX-512 or AVX2 (`vector_decode`), or none (PyTorch's ops). "auto"
takes the best this CPU has; naming one restricts the kernels to it and below (AVX-512
on a CPU with AMX, AVX2 on one with AVX-512: the code paths of other machines, testable
and measurable here). Naming one the CPU lacks is refused by name.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

ENVIRONMENT = "MG_CPU_ISA"
CHOICES = ("auto", "amx", "avx512", "avx2", "none")
ORDER = ("none", "avx2", "avx512", "amx")
"""From least to most: each needs the ones before it (on x86-64)."""

_NEEDS = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "amx": ("amx_bf16", "amx_tile"),
}
_BUILD_FLAGS = {
    "none": ("-mno-avx",),
    "avx2": ("-mno-avx512f", "-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"),
}


class CpuIsaError(ValueError):
    """--cpu-isa names an instruction set this CPU lacks, or no known one."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere or off x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def available() -> str:
    """The best instruction set of `ORDER` this CPU has."""
    flags = cpu_flags()
    best = "none"
    for isa in ORDER[1:]:
        if not all(flag in flags for flag in _NEEDS[isa]):
            break
        best = isa
    return best


def check(choice: str) -> str:
    """`choice` (one of `CHOICES`) as the instruction set to use; raises `CpuIsaError`
    where it is unknown or the CPU lacks it."""
    if choice not in CHOICES:
        raise CpuIsaError(f"--cpu-isa {choice}: choose one of {', '.join(CHOICES)}")
    best = available()
    if choice == "auto":
        return best
    if ORDER.index(choice) > ORDER.index(best):
        missing = [f for f in _NEEDS[choice] if f not in cpu_flags()]
        raise CpuIsaError(
            f"--cpu-isa {choice}: this CPU lacks {', '.join(missing) or choice} "
            f"(it has {best}); choose auto or one of {', '.join(ORDER[: ORDER.index(best) + 1])}"
        )
    return choice


def chosen() -> str:
    """The instruction set the kernels may use: `MG_CPU_ISA` (default auto), checked."""
    return check(os.environ.get(ENVIRONMENT, "auto") or "auto")


def allows(isa: str) -> bool:
    """Whether kernels for `isa` may run (the chosen set is it or above)."""
    return ORDER.index(chosen()) >= ORDER.index(isa)


def build_flags(isa: str) -> tuple[str, ...]:
    """Compiler flags that confine a kernel to `isa` (after inductor's -march=native)."""
    return _BUILD_FLAGS[isa]


def confining_flags() -> tuple[str, ...]:
    """Compiler flags that confine a kernel built for this CPU to the chosen set, where
    `--cpu-isa` chose one below the CPU's best (the decode attention kernel's build); ()
    where it did not."""
    isa = chosen()
    return _BUILD_FLAGS[isa] if isa != available() and isa in _BUILD_FLAGS else ()


def describe(isa: str) -> str:
    """`isa` with the flags of the CPU that matter to the kernels, for logs and results."""
    extra = [f for f in ("avx512_bf16", "avx512_vnni", "amx_bf16") if f in cpu_flags()]
    return f"{isa} (CPU flags: {', '.join(extra) or 'no bf16/vnni/amx'})"
