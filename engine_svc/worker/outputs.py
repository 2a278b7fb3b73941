"""What the model runner hands back to the engine core: the sampled tokens, or the logits of
a step whose sampling waits for a grammar bitmask, and that bitmask. Tensors are typed for the
checker only, so the scheduler, which reads ModelRunnerOutput, still imports no torch."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import msgspec

from engine_svc.messages import TokenLogprobs

if TYPE_CHECKING:
    import torch


class PromptLogprobsChunk(msgspec.Struct, array_like=True):
    """The logprobs of consecutive prompt tokens that one step's chunk of a prompt gives:
    `entries[i]` is prompt token `first + i`'s (the logits of the position before it)."""

    first: int
    entries: list[TokenLogprobs]


@dataclasses.dataclass(slots=True)
class ModelRunnerOutput:
    """What the forward produced: one token per request that reached the end of its input,
    and the prompt logprobs of the prompt chunks that asked for them."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    prompt_logprobs: dict[str, PromptLogprobsChunk] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class PendingSample:
    """A forward's logits whose sampling waits for a grammar bitmask (structured output)."""

    logits: torch.Tensor | None  # [rows, vocab]; None: kept by a worker process
    request_ids: list[str]
    step: int = 0  # which forward, for an executor whose workers keep the logits
    prompt_logprobs: dict[str, PromptLogprobsChunk] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class GrammarBitmask:
    """Allowed tokens for the constrained requests that sample this step."""

    request_ids: list[str]  # row i of the bitmask belongs to request_ids[i]
    bitmask: torch.Tensor  # int32 [rows, ceil(vocab / 32)]
