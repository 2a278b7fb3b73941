"""Per-request sampling parameters, validated once at the edge of the engine."""

from __future__ import annotations

import msgspec

from shared.errors import InvalidRequestError

MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The knobs of one request. The defaults are vLLM's (greedy only when temperature is 0)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model length
    min_tokens: int = 0
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top alternatives besides the sampled token

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        _check(self.temperature >= 0.0, "temperature", "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or a positive count")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed", "must be in [0, 2^63)")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        if self.logprobs is not None:
            _check(
                0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"must be in [0, {MAX_LOGPROBS}]"
            )


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field, message)
