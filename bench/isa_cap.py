"""Run a benchmark as a CPU without AMX (or without AVX-512) would run it, on one that has it.

Every side of a comparison is capped the same way, through the switches the libraries
themselves read at start-up: PyTorch's own vectorized kernels (`ATEN_CPU_CAPABILITY`),
MKL's GEMMs (`MKL_ENABLE_INSTRUCTIONS`), oneDNN's (`ONEDNN_MAX_CPU_ISA`: its bf16
matmuls take AMX where it is allowed), and mg's kernels (`MG_CPU_ISA`). The cores,
caches and memory stay this machine's, so a capped figure says what the code does with
the instruction set, not what another machine's memory would give; results name both.

The caps (the CPUs they stand for):
- `avx512-bf16`: AVX-512 with VNNI and AVX512-BF16, no AMX (AMD Zen 4/5, Intel Cooper Lake)
- `avx512`: AVX-512 with VNNI, no bf16 instructions (Intel Skylake-X to Ice Lake)
- `avx2`: AVX2 and FMA (Intel Haswell on, AMD Zen 1-3, most laptops)
"""

from __future__ import annotations

import os
import sys

CAPS: dict[str, dict[str, str]] = {
    "avx512-bf16": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "MG_CPU_ISA": "avx512",
    },
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
        "MG_CPU_ISA": "avx512",
    },
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MG_CPU_ISA": "avx2",
    },
}
CHOICES = ("native", *CAPS)
_MARK = "MG_BENCH_ISA_CAP"


def apply(cap: str) -> None:
    """Re-run this process with `cap`'s environment (the libraries read it when loaded, so
    it must be there from the start); returns at once for `native` or once applied."""
    if cap == "native" or os.environ.get(_MARK) == cap:
        return
    env = {**os.environ, **CAPS[cap], _MARK: cap}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def environment(cap: str) -> dict[str, str]:
    """The variables of `cap` (none for `native`), for a child process."""
    return dict(CAPS.get(cap, {}))


def cpu_flags() -> list[str]:
    """The flags of /proc/cpuinfo that decide the kernels (what `lscpu` lists)."""
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
    try:
        with open("/proc/cpuinfo") as f:
            line = next((x for x in f if x.startswith("flags")), "")
    except OSError:
        return []
    have = set(line.split(":", 1)[-1].split())
    return [flag for flag in wanted if flag in have]


def describe(cap: str) -> str:
    """One line for the results: the CPU's model and flags, and the cap in force."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), "")
    except OSError:
        pass
    line = f"CPU: {model or 'unknown'} (flags: {' '.join(cpu_flags()) or 'n/a'})"
    if cap == "native":
        return line + "; no cap: every library uses what the CPU has"
    caps = " ".join(f"{k}={v}" for k, v in CAPS[cap].items())
    return line + f"; capped as a CPU with {cap} only ({caps})"
