"""engine_svc: the engine core (scheduler, paged KV cache, model executor) and its service."""

from engine_svc.llm import LLM, RequestOutput
from engine_svc.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
