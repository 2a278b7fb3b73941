"""What a worker's memory holds besides the KV cache: the engine core sizes the cache from it."""

from __future__ import annotations

import torch

from engine_svc.executor.base import WorkerMemory
from engine_svc.worker.model_runner import ModelRunner

# CPU memory has no allocator statistics: the resident-set growth of a short forward catches
# fixed costs, the runner's estimate covers the part that grows with the batch, and a
# full-size forward would add seconds to each start.
CPU_PROFILE_TOKENS = 128


def profile_worker_memory(
    runner: ModelRunner, max_batched_tokens: int, max_num_seqs: int, measure: bool
) -> WorkerMemory:
    """Run on the thread that runs the runner's forwards (and, under tensor or pipeline
    parallelism, on every rank at once: the profile forward joins the collectives)."""
    activation = 0
    if measure:
        num_seqs = min(max_num_seqs, max_batched_tokens)
        profile_tokens = max_batched_tokens
        if runner.device.type == "cpu":
            profile_tokens = min(max_batched_tokens, CPU_PROFILE_TOKENS)
        measured = runner.profile_activation_bytes(profile_tokens, min(num_seqs, profile_tokens))
        estimated = runner.estimate_activation_bytes(max_batched_tokens, num_seqs)
        activation = max(measured, estimated)
    total = 0
    if runner.device.type == "cuda":
        total = torch.cuda.get_device_properties(runner.device).total_memory
    return WorkerMemory(
        device_type=runner.device.type,
        device_total_bytes=total,
        weight_bytes=runner.weight_bytes,
        activation_bytes=activation,
        kv_bytes_per_block=runner.kv_bytes_per_block(),
    )
