"""The typed messages that cross the engine core's boundary (in process or over ZMQ).

They are msgspec structs so that the multi-process clients can send them as msgpack:
compact, typed, and never pickle.
"""

from __future__ import annotations

import enum

import msgspec

from engine_svc.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Numbered as engine.v1.FinishReason (0 there is "not finished"), so conversion is a cast."""

    STOP = 1  # EOS or a stop token id
    LENGTH = 2  # max_tokens or the model length
    ABORT = 3  # cancelled by the client or by shutdown
    ERROR = 4  # the request failed inside the engine

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first under the priority policy, as in vLLM


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs for one sampled token: its own, then the top-k alternatives, most likely first."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


class RequestTimes(msgspec.Struct, array_like=True):
    """When the engine core queued a request and first scheduled it (time.monotonic(), the
    clock of EngineCoreOutputs.timestamp): sent once, with the request's first token."""

    queued: float
    scheduled: float


class EngineCoreOutput(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # With prompt_logprobs: one per prompt token after the first (the first has no context),
    # sent once, with the first new token.
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended the request, if any
    num_cached_tokens: int = 0
    error: str | None = None
    times: RequestTimes | None = None
    # With FinishReason.ERROR: the request's own field that made it fail (a constraint no
    # token can continue), so gRPC callers get INVALID_ARGUMENT naming it, not an engine fault.
    invalid_field: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, kw_only=True, array_like=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0  # cumulative, in tokens
    num_preemptions: int = 0  # cumulative
    num_prompt_tokens: int = 0  # computed this step
    num_generation_tokens: int = 0  # sampled this step
    num_batches_in_flight: int = 0  # in the executor after this step (the batch queue)


class EngineCoreOutputs(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # the engine core's time.monotonic() when the step ended
