"""The scalar sampling fields that frontend.v1's and engine.v1's SamplingParams both have,
with the same numbers and meanings, by how an unset value reads: the converters on each
side copy them by name."""

from __future__ import annotations

from typing import Literal, get_args

# proto3 `optional` fields: unset keeps the engine's default, so they are copied only when set.
OptionalSamplingField = Literal[
    "temperature", "top_p", "seed", "repetition_penalty", "logprobs", "prompt_logprobs"
]
OPTIONAL_SAMPLING_FIELDS: tuple[OptionalSamplingField, ...] = get_args(OptionalSamplingField)

# Plain fields, whose zero value is the default.
PLAIN_SAMPLING_FIELDS = (
    "top_k",
    "min_p",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
)
