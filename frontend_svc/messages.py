"""The frontend's typed messages: what a client asked for, what an engine sends back, and the
deltas the frontend streams out. Protobuf is converted to and from these at the edges only."""

from __future__ import annotations

import dataclasses
import enum


class FinishReason(enum.IntEnum):
    """The engine's finish reasons; the values are the protos' enum numbers (frontend and
    engine alike), so conversion is a cast."""

    STOP = 1  # EOS, a stop token id, or a stop string
    LENGTH = 2  # max_tokens or the model length
    ABORT = 3  # aborted (engine shutdown)
    ERROR = 4  # the request failed inside the engine


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """The engine's knobs (validated by the engine) and the frontend's text-level ones."""

    max_tokens: int | None = None  # None: up to the model length
    temperature: float | None = None  # None: the engine's default (1.0)
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the request's, asked of choice 0's engine call only
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    allowed_token_ids: tuple[int, ...] = ()  # empty: any token
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # the frontend's tokens of bad_words
    # Structured output (at most one), enforced by the engine.
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None  # JSON
    # Applied by the frontend, never sent to an engine.
    n: int = 1
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens
    bad_words: tuple[str, ...] = ()  # sent as bad_words_token_ids

    def for_choice(self, index: int) -> SamplingOptions:
        """Choice i samples with seed + i, so n seeded choices differ yet are reproducible.
        The prompt is the same for all: only choice 0 computes its logprobs."""
        if index == 0 or (self.seed is None and self.prompt_logprobs is None):
            return self
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, seed=seed, prompt_logprobs=None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """A client's request. Exactly one of prompt, prompt_token_ids, messages is set."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    sampling: SamplingOptions = SamplingOptions()
    priority: int = 0


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineRequest:
    """A client's request validated and tokenized, and each of its engine Generate calls (one
    per choice, generation.choice_request)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    priority: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineOutput:
    """One engine response: the tokens since the previous one, and how the request ended."""

    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # with the first token, if asked
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_cached_tokens: int = 0
    error: str = ""


@dataclasses.dataclass(kw_only=True)
class ChoiceDelta:
    """What one choice produced since its previous delta (or all of it, for Generate)."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # a stop string, or a stop token id

    @property
    def is_empty(self) -> bool:
        return not (self.text or self.token_ids or self.finish_reason is not None)


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationUpdate:
    """One streamed response: the choices that advanced; usage once every choice finished."""

    request_id: str
    choices: list[ChoiceDelta]
    usage: Usage | None = None
    # Prompt tokens 1.. (the first has none), once, when the request asked for them.
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """What the engines serve, as the frontend validates against it."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    architecture: str = ""
