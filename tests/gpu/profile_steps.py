"""Where a CUDA decode step's time goes: torch's profiler around a few of our engine's
offline steps (64 requests, then one), with host and device time per operator and the
share of wall time the GPU spent in kernels. For a lent GPU machine
(`bash tests/gpu/device_check.sh profile`); prints tables only.

    python tests/gpu/profile_steps.py MODEL_DIR [DEVICE]
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from engine_svc import LLM, SamplingParams


def main(model: str, device: str = "cuda") -> None:
    llm = LLM(model, dtype="bfloat16", device=device, num_kv_blocks=4096)
    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    rng = np.random.default_rng(0)
    for batch in (64, 1):
        prompts = [rng.integers(3, 40000, size=128).tolist() for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        llm.generate(prompts, params)  # shapes seen once, untimed
        _synchronize(device)
        began = time.perf_counter()
        with profile(activities=activities) as prof:
            llm.generate(prompts, params)
            _synchronize(device)
        wall = time.perf_counter() - began
        events = prof.key_averages()
        device_us = sum(e.self_device_time_total for e in events)
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel"))
        print(
            f"\n=== {batch} requests x 24 tokens: wall {wall * 1e3:.1f} ms (profiled), "
            f"GPU kernels {device_us / 1e3:.1f} ms ({100 * device_us / 1e6 / wall:.1f}% "
            f"of wall), {launches} kernel launches ({launches / 24:.0f} a step)"
        )
        print(events.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
        if len(activities) > 1:
            print(events.table(sort_by="self_device_time_total", row_limit=12,
                               max_name_column_width=60))  # fmt: skip
    llm.shutdown()


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(*sys.argv[1:3])
