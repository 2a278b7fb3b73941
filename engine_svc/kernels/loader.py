"""Build (once per machine) and load the C++ CPU kernels; see the package docstring."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

from engine_svc.kernels.build import build_library, compile_flags

logger = logging.getLogger(__name__)

NAME = "duoserve_cpu_kernels"
SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_attention.cpp",
        "prefill_attention.cpp",
        "norm_rotary.cpp",
        "packed_linear.cpp",
    )
]
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
PACKED_BLOCK_SIZES = (64, 48, 32)  # columns per packed weight block, preferred first
ENABLE_ENV = "DUOSERVE_CPU_KERNELS"  # "0": never build or load them
CACHE_ENV = "DUOSERVE_KERNEL_CACHE"  # where builds live (default ~/.cache/duoserve/kernels)
# -march for the build: "native" for the machine at hand (the default), or portable levels,
# best first and comma-separated ("x86-64-v4,x86-64-v3"): an image built once for many nodes
# holds a library per level, and each node loads the first level its CPU runs.
ARCH_ENV = "DUOSERVE_CPU_ARCH"
# CPU flags each portable level needs, checked before loading a build made for it.
_ARCH_REQUIRES = {"x86-64-v3": {"avx2", "fma", "bmi2"}, "x86-64-v4": {"avx512f", "avx512bw"}}


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "duoserve" / "kernels"


def build_levels() -> list[str]:
    """The -march levels asked for, best first."""
    value = os.environ.get(ARCH_ENV, "")
    return [level.strip() for level in value.split(",") if level.strip()] or ["native"]


def load_level() -> str | None:
    """The first level asked for that this CPU runs (a level we know no flags of counts as
    runnable), or None."""
    flags = _cpu_flags()
    return next((lv for lv in build_levels() if _ARCH_REQUIRES.get(lv, set()) <= flags), None)


def build_dir(level: str) -> Path:
    """One folder per build: the sources, torch, Python, flags, and for a native build this
    CPU's features (a home directory shared by unlike machines gets one build each)."""
    digest = hashlib.sha256()
    for source in [*SOURCES, *HEADERS]:
        digest.update(source.read_bytes())
    parts = [torch.__version__, sys.version, platform.machine(), *compile_flags(level)]
    digest.update(" ".join(parts).encode())
    if level == "native":
        digest.update(" ".join(sorted(_cpu_flags())).encode())
    return cache_root() / digest.hexdigest()[:16]


def library_path(level: str) -> Path:
    return build_dir(level) / f"{NAME}.so"


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_kernels_available() -> bool:
    """Build or load the kernels once per process; False (and a warning) when they cannot be."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        logger.info("CPU kernels off (%s=0): the model runs in plain torch", ENABLE_ENV)
        return False
    if sys.platform != "linux":
        return False
    level = load_level()
    if level is None:
        needs = {lv: sorted(_ARCH_REQUIRES.get(lv, set()) - _cpu_flags()) for lv in build_levels()}
        logger.warning(
            "CPU kernels: this CPU runs none of the levels built (%s): plain torch", needs
        )
        return False
    try:
        _build(level)
        torch.ops.load_library(str(library_path(level)))
    except Exception as error:  # no compiler, no headers: degrade, loudly
        logger.warning("CPU kernels unavailable, the model runs in plain torch: %s", error)
        return False
    return True


def _build(level: str) -> None:
    library = library_path(level)
    if library.exists():  # built before: no compiler needed
        return
    began = time.perf_counter()
    logger.info("building the CPU kernels for %s into %s (once)", level, library.parent)
    build_library(SOURCES, library, level)
    logger.info("CPU kernels built in %.1f s", time.perf_counter() - began)


def packed_linear_available(dtype: torch.dtype) -> bool:
    """Whether `packed_linear` serves this dtype on this CPU: float32, where oneDNN's brgemm
    and our register-tile kernel have AVX-512 code (measured faster than MKL here).
    Elsewhere torch's matmul stays."""
    return dtype == torch.float32 and _avx512_kernels()


def prefill_attention_available(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `prefill_attention_` serves this model: float32, head_dim a multiple of 64,
    an AVX-512 build. Elsewhere prompts attend through torch's SDPA."""
    return dtype == torch.float32 and head_dim % 64 == 0 and _avx512_kernels()


def _avx512_kernels() -> bool:
    # A native build on an AVX-512 CPU compiles the AVX-512 paths (-march=native), as does
    # an x86-64-v4 build; a portable x86-64-v3 build does not.
    return (
        platform.machine() in ("x86_64", "AMD64")
        and "avx512f" in _cpu_flags()
        and load_level() in ("native", "x86-64-v4")
        and cpu_kernels_available()
    )


def packed_block_size(out_features: int, num_threads: int | None = None) -> int:
    """Columns per packed block: the size that splits `out_features` most evenly over the
    threads (each takes whole blocks), the widest on a tie. 576 columns on 2 threads: 48."""
    threads = num_threads or torch.get_num_threads()

    def widest_share(block: int) -> int:
        blocks = -(-out_features // block)
        return -(-blocks // threads) * block

    return min(PACKED_BLOCK_SIZES, key=lambda block: (widest_share(block), -block))


def paged_decode_attention(
    q: torch.Tensor,  # [seqs, heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [seqs, max_blocks]
    context_lens: torch.Tensor,  # int32 [seqs]
    max_context_len: int,
    scale: float,
) -> torch.Tensor:
    return torch.ops.duoserve.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale
    )


def main() -> None:
    """`python -m engine_svc.kernels`: build every level asked for now (make install, an
    image build), load the one this CPU runs, and print each library's folder."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for level in build_levels():
        _build(level)
    if not cpu_kernels_available():
        raise SystemExit("CPU kernels could not be built or loaded; see the warning above")
    for level in build_levels():
        print(build_dir(level))
