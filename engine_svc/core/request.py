"""Per-request state inside the engine core. No tensors here: the scheduler owns it."""

from __future__ import annotations

import enum
from typing import Protocol

from engine_svc.messages import EngineCoreRequest, FinishReason, TokenLogprobs
from engine_svc.sampling_params import SamplingParams
from engine_svc.worker.outputs import PromptLogprobsChunk


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


class GrammarState(Protocol):
    """A constrained request's grammar, as the scheduler sees it (no tensors, no xgrammar)."""

    def is_ready(self) -> bool: ...
    @property
    def error(self) -> str | None: ...
    def accept(self, token_id: int) -> bool: ...
    @property
    def is_terminated(self) -> bool: ...

    # Why the step left the request no token to draw (its grammar allowed none, or none
    # that min_tokens does not hold back); the draw is then not the request's. None: fine.
    dead_end: str | None


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float = 0.0,
        priority: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.priority = priority
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        # Prompt then outputs, one list, so prefill after preemption is the same code path.
        # The core's one copy of the prompt.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling; -1 until then
        self.num_preemptions = 0
        # time.monotonic() when queued in the scheduler and when first scheduled (0: not yet).
        self.queued_time = 0.0
        self.scheduled_time = 0.0
        # Chained hashes of the full blocks of all_token_ids, filled by the KV-cache manager.
        self.block_hashes: list[bytes] = []
        self.structured: GrammarState | None = None  # set for structured-output requests
        self.error: str | None = None
        # With prompt_logprobs: those of prompt tokens 1, 2, ... gathered chunk by chunk until
        # they are sent with the first output token; None after that, or when not asked for.
        self.prompt_logprobs: list[TokenLogprobs] | None = (
            [] if sampling_params.prompt_logprobs is not None else None
        )

    @classmethod
    def from_engine_core_request(
        cls, request: EngineCoreRequest, eos_token_ids: frozenset[int]
    ) -> Request:
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.arrival_time,
            request.priority,
            eos_token_ids,
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def output_tail(self, count: int) -> list[int]:
        """The last `count` output tokens (all of them, where there are fewer)."""
        start = max(self.num_prompt_tokens, len(self.all_token_ids) - count)
        return self.all_token_ids[start:]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt logprobs are still to compute: its prompt takes no prefix-cache hits."""
        return self.prompt_logprobs is not None

    def add_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        """Keep a chunk's prompt logprobs. A prompt recomputed after a preemption gives the
        ones already kept again: they are skipped."""
        if self.prompt_logprobs is None:
            return
        skip = len(self.prompt_logprobs) + 1 - chunk.first
        if skip < 0:
            raise RuntimeError(
                f"request {self.request_id}: prompt logprobs from token {chunk.first}, "
                f"but only up to {len(self.prompt_logprobs)} are known"
            )
        self.prompt_logprobs.extend(chunk.entries[skip:])

    def take_prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """The prompt logprobs, once: for the output that carries the first new token."""
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def finish(self, reason: FinishReason, stop_reason: int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def check_stop(self, max_model_len: int) -> bool:
        """After a token was appended: decide whether the request is done, and why."""
        params = self.sampling_params
        last = self.all_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.finish(FinishReason.STOP)
                return True
            if last in params.stop_token_ids:
                self.finish(FinishReason.STOP, stop_reason=last)
                return True
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            self.finish(FinishReason.LENGTH)
            return True
        if self.num_tokens >= max_model_len:
            self.finish(FinishReason.LENGTH)
            return True
        return False
