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
# -march for the build: "native" for the machine at hand (the default), or a portable level
# such as x86-64-v3 (AVX2) for an image built once and run on many nodes.
ARCH_ENV = "DUOSERVE_CPU_ARCH"
# CPU flags each portable level needs, checked before loading a build made for it.
_ARCH_REQUIRES = {"x86-64-v3": {"avx2", "fma", "bmi2"}, "x86-64-v4": {"avx512f", "avx512bw"}}


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "duoserve" / "kernels"


def _arch() -> str:
    return os.environ.get(ARCH_ENV) or "native"


def _cflags() -> list[str]:
    return ["-O3", f"-march={_arch()}", "-fopenmp"]


def build_dir() -> Path:
    """One folder per build: the sources, torch, Python, flags, and for a native build this
    CPU's features (a home directory shared by unlike machines gets one build each)."""
    digest = hashlib.sha256()
    for source in [*SOURCES, *HEADERS]:
        digest.update(source.read_bytes())
    parts = [torch.__version__, sys.version, platform.machine(), *_cflags()]
    digest.update(" ".join(parts).encode())
    if _arch() == "native":
        digest.update(" ".join(sorted(_cpu_flags())).encode())
    return cache_root() / digest.hexdigest()[:16]


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def cpu_kernels_available() -> bool:
    """Build or load the kernels once per process; False (and a warning) when they cannot be."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        logger.info("CPU kernels off (%s=0): the model runs in plain torch", ENABLE_ENV)
        return False
    if sys.platform != "linux":
        return False
    missing = _ARCH_REQUIRES.get(_arch(), set()) - _cpu_flags()
    if missing:
        logger.warning("CPU kernels built for %s need %s: plain torch", _arch(), sorted(missing))
        return False
    try:
        _load()
    except Exception as error:  # no compiler, no headers: degrade, loudly
        logger.warning("CPU kernels unavailable, the model runs in plain torch: %s", error)
        return False
    return True


def _load() -> None:
    folder = build_dir()
    library = folder / f"{NAME}.so"
    if library.exists():  # built before: no compiler needed to load it
        torch.ops.load_library(str(library))
        return
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    began = time.perf_counter()
    logger.info("building the CPU kernels into %s (once per machine)", folder)
    cpp_extension.load(  # builds under a file lock, then loads the library
        name=NAME,
        sources=[str(s) for s in SOURCES],
        extra_cflags=_cflags(),
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )
    logger.info("CPU kernels built in %.1f s", time.perf_counter() - began)


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip-installed one sits beside Python."""
    try:
        import ninja  # type: ignore[import-untyped]

        bin_dir = str(ninja.BIN_DIR)
    except ImportError:
        bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, path]) if path else bin_dir


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
    # A native build on an AVX-512 CPU compiles the AVX-512 paths (-march=native); a
    # portable x86-64-v3 build does not.
    return (
        platform.machine() in ("x86_64", "AMD64")
        and "avx512f" in _cpu_flags()
        and _arch() in ("native", "x86-64-v4")
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
    """`python -m engine_svc.kernels`: build now (make install, an image build), say where."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not cpu_kernels_available():
        raise SystemExit("CPU kernels could not be built; see the warning above")
    print(build_dir())
