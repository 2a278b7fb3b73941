"""Which executor an engine runs, from its config."""

from __future__ import annotations

import torch

from engine_svc.config import EngineConfig
from engine_svc.executor.base import Executor
from engine_svc.executor.uniproc import UniProcExecutor
from engine_svc.models.model_spec import ModelSpec


def build_executor(
    config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device
) -> Executor:
    """The executor the config asks for: today one worker in this process."""
    return UniProcExecutor(
        config.model,
        spec,
        dtype,
        device,
        config.block_size,
        config.max_concurrent_batches,
        config.fail_after_steps,
        config.cpu_kernels,
    )
