"""The scheduler's decision for one step, handed to the executor (no tensors, no protobuf)."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine_svc.messages import TokenLogprobs
from engine_svc.sampling_params import SamplingParams


@dataclasses.dataclass(slots=True)
class NewRequestData:
    """Sent the first time a request is scheduled, and again when it resumes from preemption."""

    sampling_params: SamplingParams
    num_prompt_tokens: int
    all_token_ids: list[int]  # prompt and outputs so far (the runner extends its copy)


@dataclasses.dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    num_computed_tokens: int  # tokens already in the KV cache before this step
    new_block_ids: list[int]  # blocks to append to the request's block table
    new_request: NewRequestData | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # Requests whose state the model runner must drop before running this step:
    # finished, aborted or preempted since the previous step.
    freed_request_ids: list[str]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclasses.dataclass(slots=True)
class ModelRunnerOutput:
    """What the forward produced: one token per request that reached the end of its input."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs]


@dataclasses.dataclass(slots=True)
class PendingSample:
    """A forward's logits whose sampling waits for a grammar bitmask (structured output)."""

    logits: Any  # tensor [rows, vocab]; typed loosely: the scheduler does not import torch
    request_ids: list[str]


@dataclasses.dataclass(slots=True)
class GrammarBitmask:
    """Allowed tokens for the constrained requests that sample this step."""

    request_ids: list[str]  # row i of the bitmask belongs to request_ids[i]
    bitmask: Any  # int32 tensor [rows, ceil(vocab / 32)]
