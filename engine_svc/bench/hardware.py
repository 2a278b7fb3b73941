"""What a run measures on: the CPU or a CUDA device. One place that says which, describes it
and measures its ceilings, for every mode (offline, serve, openai, overhead)."""

from __future__ import annotations

import torch

from engine_svc.bench import ceiling, machine
from engine_svc.bench.ceiling_cuda import describe_device, measure_cuda_ceilings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def describe(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":
        return describe_device(device)
    return machine.describe(dtype)


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> ceiling.Ceilings:
    if device.type == "cuda":
        return measure_cuda_ceilings(dtype, device)
    # Measured twice: on a shared machine one of the two may be contended.
    return ceiling.measure_ceilings(dtype).best(ceiling.measure_ceilings(dtype))
