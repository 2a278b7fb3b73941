"""Per-request sampling parameters. `validate()` runs once, where a request enters the engine
(engine_svc/admission.py); constructing or decoding them checks nothing."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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
    # Only these tokens may be sampled (vLLM's allowed_token_ids). Logprobs stay the model's.
    allowed_token_ids: list[int] | None = None
    # Token sequences never generated whole (vLLM's bad_words, tokenized): a word's last token
    # is masked out wherever the output so far ends with the rest of it.
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's bad_words as text: the offline LLM tokenizes them into bad_words_token_ids (the
    # engine itself takes token ids; engine.v1 has no such field, the frontend has its own).
    bad_words: list[str] | None = None
    # Structured output: at most one of these constrains what may be generated.
    json_schema: str | None = None  # a JSON Schema, as text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (xgrammar's GBNF dialect) from `root`
    # A structural tag as JSON (tool calls): vLLM's {"structures": [...], "triggers": [...]}
    # or xgrammar's {"type": "structural_tag", "format": {...}}.
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        # Each allowed id once: the checks that some token is left count them. Words as lists,
        # which bad_word_bans compares with the output's.
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [list(word) for word in self.bad_words_token_ids]

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
    def restricts_tokens(self) -> bool:
        """Whether allowed_token_ids or bad words mask the logits."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def bad_word_span(self) -> int:
        """How many of the last output tokens bad_word_bans looks at."""
        return max((len(word) - 1 for word in self.bad_words_token_ids or ()), default=0)

    def bad_word_bans(self, output_token_ids: Sequence[int]) -> set[int]:
        """The tokens the bad words mask out after these output tokens (the whole output, or
        at least its last bad_word_span): each word's last token where the output ends with
        the rest of the word (the output alone, not the prompt, as vLLM; a one-token word
        always)."""
        bans: set[int] = set()
        num_output = len(output_token_ids)
        for word in self.bad_words_token_ids or ():
            prefix = len(word) - 1
            if prefix == 0 or (
                prefix <= num_output and list(output_token_ids[num_output - prefix :]) == word[:-1]
            ):
                bans.add(word[-1])
        return bans

    def refusal_of_every_token(
        self,
        num_output_tokens: int,
        output_tail: Sequence[int],
        eos_token_ids: Iterable[int],
        vocab_size: int,
    ) -> tuple[str, str] | None:
        """(field, why) when allowed_token_ids, the bad words and min_tokens together leave no
        token to sample after an output of `num_output_tokens` that ends with `output_tail`
        (at least its last bad_word_span); None while one is left. A grammar's own mask is
        not counted here (engine_svc/structured/manager.py counts it)."""
        bans = self.bad_word_bans(output_tail)
        held = (
            self.ending_token_ids(eos_token_ids) if num_output_tokens < self.min_tokens else set()
        )
        allowed = self.allowed_token_ids
        if allowed is None and vocab_size <= 0:
            return None  # the vocabulary is unknown (a scheduler without a model's limits)
        if len(bans) + len(held) < (vocab_size if allowed is None else len(allowed)):
            return None  # fewer masked than there are tokens to choose from
        left = set(range(vocab_size) if allowed is None else allowed) - bans
        if not left:
            return (
                "bad_words_token_ids",
                "they ban every token allowed_token_ids allows"
                if allowed is not None
                else "they ban every token",
            )
        if not left - held:
            field = "allowed_token_ids" if allowed is not None else "bad_words_token_ids"
            return (field, "before min_tokens, only tokens that end the request are left")
        return None

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
        if self.allowed_token_ids is not None:
            _check(
                bool(self.allowed_token_ids) and all(t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids",
                "must list at least one token id, each >= 0",
            )
        if self.bad_words_token_ids:
            _check(
                all(word and all(t >= 0 for t in word) for word in self.bad_words_token_ids),
                "bad_words_token_ids",
                "each must be a non-empty sequence of token ids >= 0",
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
