"""The ceilings of a CUDA device, measured in the run as ceiling.py does on CPU: the fastest
large GEMM of the dtype (cuBLAS, through torch) and a device-to-device copy (bytes read plus
written). Timed by synchronising around a few repeats, the best of several trials."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from engine_svc.bench.ceiling import Ceilings

GEMM_SIZE = 8192  # big enough to keep every multiprocessor busy for milliseconds
COPY_BYTES = 4 * 2**30  # many times the L2 (50-60 MB on Hopper)
REPEATS = 10
NUM_TRIALS = 3


def measure_cuda_ceilings(dtype: torch.dtype, device: torch.device) -> Ceilings:
    flops = _gemm_flops(dtype, device)
    bytes_per_s = _copy_bytes_per_s(device)
    torch.cuda.empty_cache()  # the engines measured next share the device
    return Ceilings(flops, bytes_per_s, gemm="cublas", memory="copy")


def _gemm_flops(dtype: torch.dtype, device: torch.device, size: int = GEMM_SIZE) -> float:
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    out = torch.empty(size, size, dtype=dtype, device=device)
    return 2 * size**3 / _best_seconds(lambda: torch.matmul(a, b, out=out), device)


def _copy_bytes_per_s(device: torch.device, num_bytes: int = COPY_BYTES) -> float:
    # Two buffers: at most a quarter of the free memory each on a small card.
    num_bytes = min(num_bytes, torch.cuda.mem_get_info(device)[0] // 4)
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _best_seconds(lambda: dst.copy_(src), device)


def _best_seconds(run: Callable[[], object], device: torch.device) -> float:
    run()
    torch.cuda.synchronize(device)
    best = math.inf
    for _ in range(NUM_TRIALS):
        start = time.perf_counter()
        for _ in range(REPEATS):
            run()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best / REPEATS


def describe_device(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    return (
        f"device: {props.name} ({props.multi_processor_count} SMs, "
        f"{props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}"
    )
