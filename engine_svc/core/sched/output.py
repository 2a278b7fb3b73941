"""The scheduler's decision for one step, handed to the executor (no tensors, no protobuf)."""

from __future__ import annotations

import dataclasses

from engine_svc.sampling_params import SamplingParams


@dataclasses.dataclass(slots=True)
class NewRequestData:
    """Sent the first time a request is scheduled, and again when it resumes from preemption."""

    sampling_params: SamplingParams
    num_prompt_tokens: int
    # Prompt and outputs so far, as of the step: the runner keeps this list as its own and
    # extends it (no further copy).
    all_token_ids: list[int]


@dataclasses.dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    num_computed_tokens: int  # tokens already in the KV cache before this step
    new_block_ids: list[int]  # blocks to append to the request's block table
    new_request: NewRequestData | None = None
    # The request's preemptions when scheduled: the outputs of a batch that was in flight
    # when it was preempted are stale (it is computed again from its start).
    num_preemptions: int = 0

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
