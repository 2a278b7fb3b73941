"""Per-request sampling parameters. `validate()` runs once, where a request enters the engine
(engine_svc/admission.py); constructing or decoding them checks nothing."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from shared.errors import InvalidRequestError

MAX_LOGPROBS = 20
SEED_BOUND = 2**63  # seeds are in [0, SEED_BOUND): a signed 64-bit integer
# The sampler divides float32 logits by these: beyond, a masked -inf becomes NaN (an
# infinite float32 temperature, a repetition penalty of 0) or a logit overflows.
FLOAT32_MAX = 3.4028234663852886e38
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6
# Temperatures under this sample greedily (vLLM's _SAMPLING_EPS).
GREEDY_BELOW = 1e-5
# A logit bias is in [-100, 100], as OpenAI's API and vLLM's gRPC contract bound it.
MAX_LOGIT_BIAS = 100.0


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The knobs of one request. The defaults are vLLM's; as there, a temperature under
    GREEDY_BELOW is greedy (1 / T would overflow the sampler's float32 arithmetic)."""

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
    # Per prompt token after the first: its logprob and rank, and this many top alternatives
    # (vLLM's prompt_logprobs). Such a prompt is computed whole: no prefix-cache hits.
    prompt_logprobs: int | None = None
    # Added to these tokens' logits before penalties, temperature and the draw (vLLM's and
    # OpenAI's logit_bias); logprobs stay the model's own.
    logit_bias: dict[int, float] | None = None
    # Structured output: at most one of these constrains what may be generated.
    json_schema: str | None = None  # a JSON Schema, as text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (xgrammar's GBNF dialect) from `root`
    # A structural tag as JSON (tool calls): vLLM's {"structures": [...], "triggers": [...]}
    # or xgrammar's {"type": "structural_tag", "format": {...}}.
    structural_tag: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def constraint(self) -> tuple[str, str] | None:
        """The structured-output constraint as (kind, spec), a cache key for its grammar."""
        if self.json_schema is not None:
            return ("json_schema", self.json_schema)
        if self.json_object:
            return ("json_object", "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", "\x00".join(self.choice))
        if self.grammar is not None:
            return ("grammar", self.grammar)
        if self.structural_tag is not None:
            return ("structural_tag", self.structural_tag)
        return None

    def ending_token_ids(self, eos_token_ids: Iterable[int]) -> set[int]:
        """The tokens that would end the request: its stop token ids, and EOS unless it
        ignores EOS. min_tokens holds these back."""
        ending = set(self.stop_token_ids)
        if not self.ignore_eos:
            ending.update(eos_token_ids)
        return ending

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field out of range."""
        _check(
            0.0 <= self.temperature <= FLOAT32_MAX,
            "temperature",
            f"must be in [0, {FLOAT32_MAX:g}] (float32)",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or a positive count")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        if self.seed is not None:
            _check(0 <= self.seed < SEED_BOUND, "seed", "must be in [0, 2^63)")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]",
        )
        if self.logprobs is not None:
            _check(
                0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"must be in [0, {MAX_LOGPROBS}]"
            )
        if self.prompt_logprobs is not None:
            _check(
                0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
            )
        if self.logit_bias:
            # Integer keys: OpenAI's JSON spells them as strings, which the offline API takes
            # unchecked.
            _check(
                all(type(t) is int and t >= 0 for t in self.logit_bias),
                "logit_bias",
                "token ids must be integers >= 0",
            )
            _check(
                all(
                    type(b) in (int, float) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                    for b in self.logit_bias.values()
                ),
                "logit_bias",
                f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            )
        self._validate_constraint()

    def _validate_constraint(self) -> None:
        given = [
            name
            for name, value in (
                ("json_schema", self.json_schema),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("structural_tag", self.structural_tag),
            )
            if value is not None
        ]
        _check(
            len(given) <= 1,
            given[-1] if given else "",
            "give at most one of json_schema, json_object, regex, choice, grammar, structural_tag",
        )
        if self.choice is not None:
            _check(bool(self.choice) and all(self.choice), "choice", "needs non-empty strings")


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field, message)
