"""The machine a benchmark ran on, printed with its figures (figures mean little without
the CPU and the kernels' level), and `--isa avx2`: every library the run uses held to
AVX2, so an AVX-512 machine measures what an AVX2-only one runs (not its caches or clock)."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch

# What each library reads to cap its vector code: torch's own kernels, MKL's GEMM,
# oneDNN's (brgemm), and our kernels' build level.
ISA_CAPS: dict[str, dict[str, str]] = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "DUOSERVE_CPU_ARCH": "x86-64-v3",
    },
}
# The CPU flag above each cap: without it, the native build of our kernels is the capped
# level's code already (vec.h), and a portable build of it would only cost a build.
_ABOVE_CAP = {"avx2": "avx512f"}
_FLAGS_SHOWN = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def isa_caps(isa: str) -> dict[str, str]:
    """The environment that holds every library to `isa` on this CPU."""
    caps = dict(ISA_CAPS[isa])
    if _ABOVE_CAP[isa] not in cpu_flags():
        caps["DUOSERVE_CPU_ARCH"] = "native"  # whatever the environment asked for
    return caps


def capped_kernel_level(isa: str) -> str:
    """The build of our kernels a run held to `isa` loads here."""
    return isa_caps(isa)["DUOSERVE_CPU_ARCH"]


def apply_isa_cap(isa: str | None, argv: list[str]) -> None:
    """Re-run this process with the environment capped at `isa`, unless it already is:
    the libraries read these variables once, when they first run."""
    if isa is None:
        return
    caps = isa_caps(isa)
    if all(os.environ.get(name) == value for name, value in caps.items()):
        return
    os.execve(sys.executable, [sys.executable, *argv], {**os.environ, **caps})


def cpu_model() -> str:
    for line in _cpuinfo():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    for line in _cpuinfo():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return [flag for flag in _FLAGS_SHOWN if flag in flags]
    return []


def has_bf16_arithmetic() -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16), as an
    `--isa` cap leaves it (capped at AVX2, oneDNN uses neither)."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2":  # as the loader reads it
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags()))


def identity() -> dict[str, str | None]:
    """The CPU and the kernels' level, for the JSON line."""
    from engine_svc.kernels.loader import loaded_build

    build = loaded_build()
    return {
        "cpu_model": cpu_model(),
        "kernel_level": None if build is None else f"{build.level} ({build.capability})",
    }


def describe(dtype: torch.dtype = torch.float32) -> str:
    """CPU, its vector flags, threads, and what torch and our kernels run on it here for
    `dtype` (the fast paths differ between float32 and bfloat16)."""
    from engine_svc.kernels.loader import describe as describe_kernels

    capped = os.environ.get("ATEN_CPU_CAPABILITY")
    lines = [
        f"machine: {cpu_model()} ({' '.join(cpu_flags()) or 'no AVX flags'}), "
        f"{len(os.sched_getaffinity(0))} threads, torch {torch.__version__} running "
        f"{torch.backends.cpu.get_cpu_capability()}" + (f" (capped: {capped})" if capped else ""),
        describe_kernels(dtype, 64),
    ]
    return "\n".join(lines)


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
