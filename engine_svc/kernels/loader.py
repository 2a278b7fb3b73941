"""Build (once per machine) and load the C++ CPU kernels; see the package docstring."""

from __future__ import annotations

import dataclasses
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
        "rms_norm.cpp",
        "rotary.cpp",
        "silu_and_mul.cpp",
        "packed_linear.cpp",
        "row_gemv.cpp",
        "bf16_pairs_linear.cpp",
        "argmax.cpp",
        "sample_rows.cpp",
        "race_rows.cpp",
        "logprobs.cpp",
        "decode_layers.cpp",
        "capability.cpp",
    )
]
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
# Vector levels where the packed projections and the prefill kernel were measured faster
# than torch (make bench, tests/engine_svc/test_kernel_speed.py); elsewhere torch's.
FAST_CAPABILITIES = frozenset({"avx512", "avx2"})
ENABLE_ENV = "DUOSERVE_CPU_KERNELS"  # "0": never build or load them
CACHE_ENV = "DUOSERVE_KERNEL_CACHE"  # where builds live (default ~/.cache/duoserve/kernels)
# -march for the build: "native" for the machine at hand (the default), or portable levels,
# best first and comma-separated ("x86-64-v4,x86-64-v3"): an image built once for many nodes
# holds a library per level, and each node loads the first level its CPU runs.
ARCH_ENV = "DUOSERVE_CPU_ARCH"
# CPU flags each portable level needs, checked before loading a build made for it.
_ARCH_REQUIRES = {"x86-64-v3": {"avx2", "fma", "bmi2"}, "x86-64-v4": {"avx512f", "avx512bw"}}
# The x86-64 levels, best first, with the vector code each compiles (csrc/vec.h).
X86_LEVELS = {"x86-64-v4": "avx512", "x86-64-v3": "avx2", "x86-64": "default"}


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


# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) from AVX512-BF16 up, AMX aside.
BF16_ONEDNN_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """The library this process loaded."""

    level: str  # the -march level it was built for: "native", "x86-64-v3", ...
    capability: str  # the vector code compiled in: "avx512", "avx2", "neon" or "default"
    lanes: int  # float32 lanes of a vector
    # Vectors per packed weight block, the register tile's fastest first (capability.cpp).
    block_vectors: tuple[int, ...]
    prefill_panel: int  # the prefill kernel's K/V panel width: head_dim must be a multiple
    # bfloat16 decode attention scores by AVX512-BF16 dot products (paged_attention.cpp).
    bf16_dot_products: bool = False
    # bfloat16 projections over pairs of k multiplied by AMX's tiles from 4 rows, where
    # in_features is a multiple of 32 (bf16_pairs_linear.cpp): built with them, and the
    # kernel grants this process the tile registers.
    amx_tiles: bool = False

    @property
    def fast(self) -> bool:
        return self.capability in FAST_CAPABILITIES


def loaded_build() -> KernelBuild | None:
    """The kernels' build in this process, loading it if need be; None without kernels."""
    if not cpu_kernels_available():
        return None
    level = load_level()
    assert level is not None
    ops = torch.ops.duoserve
    return KernelBuild(
        level,
        str(ops.cpu_capability()),
        int(ops.vector_lanes()),
        tuple(int(v) for v in ops.packed_block_vectors()),
        int(ops.prefill_attention_panel()),
        bool(ops.bf16_dot_products()),
        bool(ops.amx_tiles_usable()),
    )


def describe(dtype: torch.dtype, head_dim: int) -> str:
    """One line for the start-up log: the build loaded and the fast paths it turns on."""
    build = loaded_build()
    if build is None:
        return "CPU kernels off: plain torch"
    attention = "decode attention"
    if dtype == torch.bfloat16 and build.bf16_dot_products:
        attention += " (bfloat16 dot products)"
    paths = [attention, "fused norms, rotary and silu*up"]
    if packed_linear_available(dtype):
        paths.insert(0, "packed projections")
    elif bf16_pairs_available(dtype):
        tiles = "; AMX tiles from 4 rows" if build.amx_tiles else ""
        paths.insert(0, f"projections on bfloat16 pairs (AVX512-BF16 dot products{tiles})")
    elif onednn_linear_available(dtype):
        paths.insert(0, "projections on prepacked oneDNN weights")
    elif row_gemv_available(dtype):
        paths.insert(0, "one-row projections")
    if prefill_attention_available(dtype, head_dim):
        paths.insert(1, "prefill attention")
    return (
        f"CPU kernels: {build.level} build ({build.capability}, {build.lanes} float32 lanes); "
        f"on: {', '.join(paths)}"
    )


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


@functools.cache
def torch_bf16_matmul_is_scalar() -> bool:
    """Whether torch's bfloat16 matmul is a scalar loop here: oneDNN has no bfloat16 kernel
    for this CPU (torch's own check: AVX-512, AVX512-BF16, AMX and Arm's BF16 have one,
    AVX2 has none), or oneDNN is held to AVX2 (`make bench ARGS="--isa avx2"`). Decided
    once per process, for the projections and attention alike."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2":
        return True
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _kernel_dtype(dtype: torch.dtype) -> bool:
    """float32; and bfloat16 where torch's bfloat16 matmul is a scalar loop: the kernels
    widen it and compute in float32 (elsewhere torch's oneDNN bfloat16 paths stay)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch_bf16_matmul_is_scalar())


def packed_linear_available(dtype: torch.dtype) -> bool:
    """Whether `packed_linear` serves this dtype here (float32, and bfloat16 where torch's
    bfloat16 matmul is scalar), on a level where it was measured faster than torch's
    matmul (AVX-512 and AVX2). Elsewhere torch's matmul stays."""
    build = loaded_build() if _kernel_dtype(dtype) else None
    return build is not None and build.fast


def onednn_linear_available(dtype: torch.dtype) -> bool:
    """Whether bfloat16 projections keep their weights in oneDNN's blocked layout
    (`Projection.use_onednn`): where torch's bfloat16 matmul is oneDNN's and the CPU has
    bfloat16 arithmetic, AMX or AVX512-BF16, where it was measured (SmolLM2-135M's
    projections against F.linear: 1.2-1.5x at 1 to 256 rows on an Intel Xeon with AMX;
    1.4-2x at 2 to 16 rows and 1.2x at 64 on an AMD EPYC Zen 5). Elsewhere (AVX-512 without
    BF16, where oneDNN emulates it), and where oneDNN is held below those ISAs
    (ONEDNN_MAX_CPU_ISA), torch's F.linear stays."""
    return (
        dtype == torch.bfloat16
        and _onednn_isa_allows_bf16()
        and torch.backends.mkldnn.is_available()
        and not torch_bf16_matmul_is_scalar()
        and (torch.cpu._is_amx_tile_supported() or "avx512_bf16" in _cpu_flags())
    )


def bf16_pairs_available(dtype: torch.dtype) -> bool:
    """Whether bfloat16 projections take `bf16_pairs_linear` (bf16_pairs_linear.cpp) over
    weights packed in pairs of k (prompt steps too, where no oneDNN copy is kept beside them:
    Projection.use_bf16_pairs): on AVX512-BF16, in a build with its dot products, and where
    the CPU has AMX only in a build that multiplies the pairs with its tiles (oneDNN's AMX
    kernels beat the dot products at a batch's rows). Measured on the Zen 5 (SmolLM2-135M's
    120 decoder projections and LM head, weights streaming from memory): 64 rows 19.4 ms
    against oneDNN's prepacked 23.9, 1 row 4.4-5.5 against 5.6-6.1 (and the row GEMV's 5.6),
    256 rows 73.7 against 75-77; a 2,048-row prefill projection 0.95-0.97x oneDNN's. On the
    Xeon with AMX, on huge pages: 1 row 9.6-10.3 ms against the row GEMV's 16.4 and oneDNN's
    18.6-22.2, 16 rows 12.7-13.6 against oneDNN's 18.8-21.2, 64 rows 17.5-23.8 against
    24.2-25.1, 2,048 rows 1.3x oneDNN's time (bf16_pairs_amx.h)."""
    if dtype != torch.bfloat16:
        return False
    build = loaded_build()
    if build is None or not (build.fast and build.bf16_dot_products):
        return False
    return build.amx_tiles or not torch.cpu._is_amx_tile_supported()


def _onednn_isa_allows_bf16() -> bool:
    """Whether ONEDNN_MAX_CPU_ISA, if set, leaves oneDNN its bfloat16 instructions."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return not cap or cap == "ALL" or "AMX" in cap or cap.startswith(BF16_ONEDNN_ISAS)


def row_gemv_available(dtype: torch.dtype) -> bool:
    """Whether a single row through a bfloat16 projection takes `row_gemv` (row_gemv.cpp)
    over the [out, in] weight torch's F.linear reads for more rows: bfloat16 where torch's
    bfloat16 matmul is oneDNN's (elsewhere the packed kernel serves it), on a level where the
    kernel was measured faster than torch's (one row: 16-17 ms for SmolLM2-135M's
    projections against 22-33 on the AMD EPYC Zen 4)."""
    if dtype != torch.bfloat16 or torch_bf16_matmul_is_scalar() or onednn_linear_available(dtype):
        return False
    return _fast_build_loaded()


def one_row_copy_available(dtype: torch.dtype) -> bool:
    """Whether bfloat16 projections prepacked for oneDNN can also keep their [out, in]
    weights for `row_gemv`'s single rows (Projection.use_onednn's keep_rows): the kernels
    built at a level where the GEMV was measured faster than torch."""
    return onednn_linear_available(dtype) and _fast_build_loaded()


def _fast_build_loaded() -> bool:
    build = loaded_build()
    return build is not None and build.fast


def prefill_attention_available(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `prefill_attention_` serves this model: float32 or bfloat16 (widened as it
    is read, computed in float32), head_dim a multiple of the kernel's K/V panel (64 floats
    on AVX-512, 16 on AVX2), on a level where it was measured faster than torch's SDPA.
    Elsewhere prompts attend through SDPA. bfloat16 where torch's is oneDNN's (AVX512-BF16,
    Zen 5): 2.4 ms a layer against SDPA's 9 for 2,048 prompt tokens in 15 chunks."""
    build = loaded_build() if dtype in (torch.float32, torch.bfloat16) else None
    return build is not None and build.fast and head_dim % build.prefill_panel == 0


def packed_block_size(
    out_features: int,
    num_threads: int | None = None,
    lanes: int | None = None,
    block_vectors: tuple[int, ...] | None = None,
) -> int:
    """Columns per packed block, a whole number of vectors: the width that splits
    `out_features` most evenly over the threads (each takes whole blocks), and on a tie the
    width the register tile runs fastest (this build's `block_vectors`). 576 columns on 2
    threads: 48 with AVX-512 (16 lanes, 4 vectors preferred), 24 with AVX2 (8 lanes, 3)."""
    threads = num_threads or torch.get_num_threads()
    if lanes is None or block_vectors is None:
        build = loaded_build()
        lanes = lanes or (build.lanes if build is not None else 16)
        block_vectors = block_vectors or (build.block_vectors if build is not None else (4, 3, 2))

    def widest_share(block: int) -> int:
        blocks = -(-out_features // block)
        return -(-blocks // threads) * block

    sizes = [vectors * lanes for vectors in block_vectors]
    return min(sizes, key=lambda block: (widest_share(block), sizes.index(block)))


def paged_decode_attention(
    q: torch.Tensor,  # [seqs, heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [seqs, max_blocks]
    context_lens: torch.Tensor,  # int32 [seqs]
    max_context_len: int,
    scale: float,
    window: int | None = None,  # attend to the last `window` tokens only
) -> torch.Tensor:
    return torch.ops.duoserve.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale, window or 0
    )


def other_levels(loaded_capability: str) -> list[str]:
    """The x86-64 levels this CPU runs whose vector code is not the loaded build's: each
    one's kernels are tested in a process of their own (tests/engine_svc/test_kernel_levels.py).
    Beside a native build, x86-64-v3 on an AVX-512 machine and plain x86-64 everywhere; on
    an AVX2 machine the native build already is the AVX2 code."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = _cpu_flags()
    return [
        level
        for level, capability in X86_LEVELS.items()
        if capability != loaded_capability and _ARCH_REQUIRES.get(level, set()) <= flags
    ]


def main(argv: list[str] | None = None) -> None:
    """`python -m engine_svc.kernels [--build-only | --other-levels]`: build every level asked
    for now (make install, an image build), load the one this CPU runs unless told not to,
    and print each library's folder. With --other-levels, the x86-64 levels the tests run
    beside the loaded one are built too (`other_levels`)."""
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    levels = build_levels()
    for level in levels:
        _build(level)
    if "--build-only" not in args:
        build = loaded_build()
        if build is None:
            raise SystemExit("CPU kernels could not be built or loaded; see the warning above")
        print(describe(torch.float32, 64))
        if "--other-levels" in args:
            others = [lv for lv in other_levels(build.capability) if lv not in levels]
            for level in others:
                _build(level)
            levels += others
    for level in levels:
        print(build_dir(level))
