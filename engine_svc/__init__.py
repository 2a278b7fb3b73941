"""engine_svc: the engine core (scheduler, paged KV cache, model executor) and its service.

`from engine_svc import LLM, SamplingParams` works as before, but loads the offline API (and
torch) only when asked for: importing the scheduler, or the gRPC server process, must not."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_svc.llm import LLM, RequestOutput
    from engine_svc.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "engine_svc.llm",
    "RequestOutput": "engine_svc.llm",
    "SamplingParams": "engine_svc.sampling_params",
}

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine_svc' has no attribute {name!r}")
