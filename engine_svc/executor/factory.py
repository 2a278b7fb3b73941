"""Which executor an engine runs, from its config."""

from __future__ import annotations

import torch

from engine_svc.config import EngineConfig
from engine_svc.core.kv_cache.sizing import cpu_worker_budget_bytes
from engine_svc.distributed.layout import ParallelLayout
from engine_svc.executor.base import Executor
from engine_svc.executor.uniproc import UniProcExecutor
from engine_svc.models.model_spec import ModelSpec
from engine_svc.models.sharding import check_divisible


def build_executor(
    config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device
) -> Executor:
    """Worker processes for tensor or pipeline parallelism, else one worker in this process;
    or, for measuring the engine's own cost, no model at all (`null_executor`)."""
    if config.null_executor:
        from engine_svc.executor.null import NullExecutor

        element = torch.tensor([], dtype=dtype).element_size()
        return NullExecutor(config.model, spec, config.block_size, element)
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        from engine_svc.executor.multiproc import MultiprocExecutor

        layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
        check_divisible(spec, layout)  # here, before any worker starts
        return MultiprocExecutor(config)
    return UniProcExecutor(
        config.model,
        spec,
        dtype,
        device,
        config.block_size,
        config.max_concurrent_batches,
        config.fail_after_steps,
        config.cpu_kernels,
        cpu_worker_budget_bytes(config) if device.type == "cpu" else None,
        config.enforce_eager,
    )
