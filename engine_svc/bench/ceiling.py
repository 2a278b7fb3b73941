"""The machine's ceilings for `engine_svc.bench`: GEMM FLOP/s and memory bandwidth, measured
in the run, and the fractions of them (MFU, MBU) a measured throughput or latency reaches.
Each ceiling is the fastest way this process has to do the thing: torch's, and the engine's
own kernels where they serve the dtype."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from engine_svc.kernels.loader import (
    bf16_pairs_available,
    one_row_copy_available,
    onednn_linear_available,
    packed_block_size,
    packed_linear_available,
    row_gemv_available,
    torch_bf16_matmul_is_scalar,
)

GEMM_SIZE = 2048
GEMM_REPEATS = 2
COPY_BYTES = 512 * 2**20
NUM_TRIALS = 5


@dataclasses.dataclass(frozen=True)
class Ceilings:
    flops_per_s: float  # best large GEMM of the dtype
    bytes_per_s: float  # best large stream of memory (measure_memory_bandwidth)
    gemm: str = "torch"  # whose GEMM: "torch", "packed" or "pairs" (ours), "onednn" (prepacked)
    memory: str = "copy"  # which stream: "copy", "read", "packed", "pairs" or "row_gemv"

    def best(self, other: Ceilings) -> Ceilings:
        """A ceiling is a maximum: keep the higher of two measurements of each."""
        faster = self if self.flops_per_s >= other.flops_per_s else other
        wider = self if self.bytes_per_s >= other.bytes_per_s else other
        return Ceilings(faster.flops_per_s, wider.bytes_per_s, faster.gemm, wider.memory)


def measure_ceilings(dtype: torch.dtype = torch.float32) -> Ceilings:
    gemm, flops = measure_gemm_flops(gemm_dtype(dtype))
    memory, bytes_per_s = measure_memory_bandwidth(dtype)
    return Ceilings(flops, bytes_per_s, gemm, memory)


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose GEMM bounds a model of `dtype`: float32 for bfloat16 where torch's
    bfloat16 GEMM is a scalar loop (AVX2: about 1 GFLOP/s, no ceiling, and minutes to
    measure), as the engine then computes in float32 over bfloat16 weights."""
    if dtype == torch.bfloat16 and torch_bf16_matmul_is_scalar():
        return torch.float32
    return dtype


def measure_gemm_flops(
    dtype: torch.dtype = torch.float32, size: int = GEMM_SIZE
) -> tuple[str, float]:
    """The fastest square GEMM this process has for `dtype`, and its FLOP/s: torch's matmul,
    and the engine's own projection paths where they serve the dtype (float32's packed
    kernel; bfloat16 on oneDNN's prepacked weights, and on pairs of k for AVX512-BF16). A
    ceiling is what the machine can do: MKL's float32 GEMM runs well below the FMA units'
    rate on AMD EPYC, where a batch through our kernel read as 171% of it."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    out = torch.empty(size, size, dtype=dtype)
    gemms: dict[str, Callable[[], object]] = {"torch": lambda: torch.matmul(a, b, out=out)}
    if packed_linear_available(dtype):
        packed = torch.ops.duoserve.pack_linear_weight(b, packed_block_size(size))
        gemms["packed"] = lambda: torch.ops.duoserve.packed_linear(a, packed, size, None)
    if onednn_linear_available(dtype):
        reordered = torch.ops.mkldnn._reorder_linear_weight(b)
        gemms["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(
            a, reordered, None, "none", [], ""
        )
    if bf16_pairs_available(dtype):
        pairs = torch.ops.duoserve.pack_bf16_pairs(b.t().contiguous())
        gemms["pairs"] = lambda: torch.ops.duoserve.bf16_pairs_linear(a, pairs, size, None)
    rates = {name: 2 * size**3 / _best_seconds(gemm) for name, gemm in gemms.items()}
    fastest = max(rates, key=rates.__getitem__)
    return fastest, rates[fastest]


def _best_seconds(gemm: Callable[[], object]) -> float:
    """One GEMM's time: the best of a few trials of `GEMM_REPEATS`, after a warm-up call
    (the kernels, the pages of the output)."""
    gemm()
    best = math.inf
    for _ in range(NUM_TRIALS):
        start = time.perf_counter()
        for _ in range(GEMM_REPEATS):
            gemm()
        best = min(best, time.perf_counter() - start)
    return best / GEMM_REPEATS


def measure_memory_bandwidth(
    dtype: torch.dtype = torch.float32, num_bytes: int = COPY_BYTES
) -> tuple[str, float]:
    """The fastest stream of `num_bytes` this process has, and its bytes/s: a copy (read
    plus write bytes), a read (torch's max), and the engine's one-row projection over a
    weight of that size where a kernel serves the dtype (float32's packed kernel; bfloat16's
    pairs kernel, or its row GEMV), which is what one request's decode does with the model's
    weights. On the Zen 5 the three ran at 39-46 GB/s. A last-level cache that keeps part of
    a small model's weights from one token to the next (32 MiB there, against SmolLM2's 538
    MB in float32) lets a decode pass this ceiling: one float32 request read its weights at
    48 GB/s."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    streams: dict[str, tuple[int, Callable[[], object]]] = {
        "copy": (2 * num_bytes, lambda: dst.copy_(src)),
        "read": (num_bytes, lambda: src.max()),
    }
    width = 4096  # the weight's input features; its rows fill num_bytes
    rows = num_bytes // (width * dtype.itemsize)
    row = torch.ones(1, width, dtype=dtype)
    if packed_linear_available(dtype):
        weight = torch.ones(rows, width, dtype=dtype)
        packed = torch.ops.duoserve.pack_linear_weight(weight, packed_block_size(rows))
        del weight
        streams["packed"] = (
            num_bytes,
            lambda: torch.ops.duoserve.packed_linear(row, packed, rows, None),
        )
    elif bf16_pairs_available(dtype):
        weight = torch.ones(rows, width, dtype=dtype)
        pairs = torch.ops.duoserve.pack_bf16_pairs(weight)
        del weight
        streams["pairs"] = (
            num_bytes,
            lambda: torch.ops.duoserve.bf16_pairs_linear(row, pairs, rows, None),
        )
    elif row_gemv_available(dtype) or one_row_copy_available(dtype):
        weight = torch.ones(rows, width, dtype=dtype)
        streams["row_gemv"] = (num_bytes, lambda: torch.ops.duoserve.row_gemv(row, weight, None))
    rates = {name: size / _best_seconds(run) for name, (size, run) in streams.items()}
    fastest = max(rates, key=rates.__getitem__)
    return fastest, rates[fastest]


def count_parameters(model_dir: str | Path) -> int:
    """Parameters each token runs through, from the checkpoint: a tied embedding counted
    once (it is also the LM head), and a mixture's experts as the share of them a token is
    routed to (num_experts_per_tok of num_experts)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", False))
    num_experts = config.get("num_local_experts") or config.get("num_experts") or 0
    routed = (
        (config.get("num_experts_per_tok") or num_experts) / num_experts if num_experts else 1.0
    )
    total = 0.0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if tied and name == "lm_head.weight":
                    continue
                size = math.prod(handle.get_slice(name).get_shape())
                total += size * routed if ".experts." in name else size
    return round(total)


def model_flops_utilization(num_params: int, tokens_per_s: float, ceilings: Ceilings) -> float:
    """2 FLOPs per parameter per token through the model; attention scores are left out."""
    return 2 * num_params * tokens_per_s / ceilings.flops_per_s


def memory_bandwidth_utilization(
    weight_bytes: int, seconds_per_token: float, ceilings: Ceilings
) -> float:
    """Each decode step of one request reads every weight once; its KV reads are left out."""
    return weight_bytes / seconds_per_token / ceilings.bytes_per_s


def utilization_figures(
    ceilings: Ceilings,
    num_params: int,
    bytes_per_param: int,
    batch_tokens_per_s: float,
    decode_s_per_token: float,
) -> dict[str, float | int | str | None]:
    """The ceilings, and the fractions of them a batched run and a single decode reach. A
    decode time of zero or less (a request so short that the machine's noise exceeds its
    decode) gives no MBU (None), not a meaningless one."""
    weight_bytes = num_params * bytes_per_param
    mbu = None
    if decode_s_per_token > 0:
        mbu = memory_bandwidth_utilization(weight_bytes, decode_s_per_token, ceilings)
    return {
        "gemm_gflops": ceilings.flops_per_s / 1e9,
        "gemm": ceilings.gemm,
        "memory_gb_s": ceilings.bytes_per_s / 1e9,
        "memory": ceilings.memory,
        "num_params": num_params,
        "mfu": model_flops_utilization(num_params, batch_tokens_per_s, ceilings),
        "mbu": mbu,
    }


def describe(figures: Mapping[str, float | int | str | None]) -> str:
    return (
        f"ceilings: GEMM {figures['gemm_gflops']:.1f} GFLOP/s ({figures.get('gemm', 'torch')}), "
        f"memory {figures['memory_gb_s']:.1f} GB/s ({figures.get('memory', 'copy')})\n"
        f"MFU of the batch, counting 2 x {figures['num_params']} params per token x "
        f"(prompt + output) tokens/s: {100 * (figures['mfu'] or 0):.1f}%\n"
        f"MBU of 1-request decode, counting weight bytes per token: "
        + (
            "not measurable (noise exceeded the decode time)"
            if figures["mbu"] is None
            else f"{100 * float(figures['mbu']):.1f}%"
        )
    )
