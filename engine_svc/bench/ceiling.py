"""The machine's ceilings for `engine_svc.bench`: GEMM FLOP/s and copy bandwidth, measured
in the run, and the fractions of them (MFU, MBU) a measured throughput or latency reaches."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from engine_svc.kernels.loader import torch_bf16_matmul_is_scalar

GEMM_SIZE = 2048
GEMM_REPEATS = 2
COPY_BYTES = 512 * 2**20
NUM_TRIALS = 5


@dataclasses.dataclass(frozen=True)
class Ceilings:
    flops_per_s: float  # best large float32 GEMM
    bytes_per_s: float  # best large copy, read plus write bytes

    def best(self, other: Ceilings) -> Ceilings:
        """A ceiling is a maximum: keep the higher of two measurements of each."""
        return Ceilings(
            max(self.flops_per_s, other.flops_per_s), max(self.bytes_per_s, other.bytes_per_s)
        )


def measure_ceilings(dtype: torch.dtype = torch.float32) -> Ceilings:
    return Ceilings(
        flops_per_s=measure_gemm_flops(gemm_dtype(dtype)), bytes_per_s=measure_copy_bandwidth()
    )


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose GEMM bounds a model of `dtype`: float32 for bfloat16 where torch's
    bfloat16 GEMM is a scalar loop (AVX2: about 1 GFLOP/s, no ceiling, and minutes to
    measure), as the engine then computes in float32 over bfloat16 weights."""
    if dtype == torch.bfloat16 and torch_bf16_matmul_is_scalar():
        return torch.float32
    return dtype


def measure_gemm_flops(dtype: torch.dtype = torch.float32, size: int = GEMM_SIZE) -> float:
    """Best of a few trials of `GEMM_REPEATS` square matmuls into a preallocated output."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    out = torch.empty(size, size, dtype=dtype)
    torch.matmul(a, b, out=out)  # warm the kernels and the pages of `out`
    best = math.inf
    for _ in range(NUM_TRIALS):
        start = time.perf_counter()
        for _ in range(GEMM_REPEATS):
            torch.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 * GEMM_REPEATS / best


def measure_copy_bandwidth(num_bytes: int = COPY_BYTES) -> float:
    """Best of a few copies between two preallocated buffers, counting read and write."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best = math.inf
    for _ in range(NUM_TRIALS):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


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
) -> dict[str, float | int | None]:
    """The ceilings, and the fractions of them a batched run and a single decode reach. A
    decode time of zero or less (a request so short that the machine's noise exceeds its
    decode) gives no MBU (None), not a meaningless one."""
    weight_bytes = num_params * bytes_per_param
    mbu = None
    if decode_s_per_token > 0:
        mbu = memory_bandwidth_utilization(weight_bytes, decode_s_per_token, ceilings)
    return {
        "gemm_gflops": ceilings.flops_per_s / 1e9,
        "copy_gb_s": ceilings.bytes_per_s / 1e9,
        "num_params": num_params,
        "mfu": model_flops_utilization(num_params, batch_tokens_per_s, ceilings),
        "mbu": mbu,
    }


def describe(figures: Mapping[str, float | int | str | None]) -> str:
    return (
        f"ceilings: GEMM {figures['gemm_gflops']:.1f} GFLOP/s, "
        f"copy {figures['copy_gb_s']:.1f} GB/s (read+write)\n"
        f"MFU of the batch, counting 2 x {figures['num_params']} params per token x "
        f"(prompt + output) tokens/s: {100 * (figures['mfu'] or 0):.1f}%\n"
        f"MBU of 1-request decode, counting weight bytes per token: "
        + (
            "not measurable (noise exceeded the decode time)"
            if figures["mbu"] is None
            else f"{100 * float(figures['mbu']):.1f}%"
        )
    )
