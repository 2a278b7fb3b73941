"""Every check the frontend makes on client input, in one place. Each failure raises
InvalidRequestError naming the field as the client spells it (INVALID_ARGUMENT). The engine
checks the sampling knobs it owns, and names them the same way."""

from __future__ import annotations

from collections.abc import Sequence

from frontend_svc.messages import ChatMessage, GenerationRequest, ModelInfo, SamplingOptions
from shared.errors import InvalidRequestError

# Room is left under the engine's 256-character request ids for the per-choice suffix.
MAX_REQUEST_ID_CHARS = 200
MAX_N = 128
MAX_STRINGS = 32  # stop strings, and bad words
MAX_STRING_CHARS = 512
MAX_MESSAGES = 4096
MAX_SEED = 2**63  # the engine's bound; choice i uses seed + i


def validate_request(request: GenerationRequest) -> None:
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            "request_id", f"{len(request.request_id)} characters is over {MAX_REQUEST_ID_CHARS}"
        )
    inputs = {
        "prompt": request.prompt is not None,
        "prompt_token_ids": request.prompt_token_ids is not None,
        "messages": request.messages is not None,
    }
    if sum(inputs.values()) != 1:
        given = ", ".join(name for name, is_set in inputs.items() if is_set) or "none"
        raise InvalidRequestError(
            "prompt", f"give exactly one of prompt, prompt_token_ids, messages (given: {given})"
        )
    if request.messages is not None:
        validate_messages(request.messages)
    validate_sampling(request.sampling)


def validate_messages(messages: Sequence[ChatMessage]) -> None:
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequestError("messages", f"{len(messages)} messages is over {MAX_MESSAGES}")
    for index, message in enumerate(messages):
        if not message.role:
            raise InvalidRequestError(f"messages[{index}].role", "must not be empty")


def validate_sampling(sampling: SamplingOptions) -> None:
    if not 1 <= sampling.n <= MAX_N:
        raise InvalidRequestError("sampling_params.n", f"must be in [1, {MAX_N}]")
    if sampling.seed is not None and sampling.seed + sampling.n > MAX_SEED:
        raise InvalidRequestError("sampling_params.seed", "seed + n must be at most 2^63")
    if sampling.truncate_prompt_tokens is not None and sampling.truncate_prompt_tokens < 1:
        raise InvalidRequestError("sampling_params.truncate_prompt_tokens", "must be at least 1")
    _check_strings("sampling_params.stop", "stop strings", sampling.stop)
    _check_strings("sampling_params.bad_words", "bad words", sampling.bad_words)
    if not all(word.strip() for word in sampling.bad_words):
        raise InvalidRequestError("sampling_params.bad_words", "a word of spaces bans nothing")


def _check_strings(field: str, what: str, strings: Sequence[str]) -> None:
    if len(strings) > MAX_STRINGS:
        raise InvalidRequestError(field, f"{len(strings)} {what} is over {MAX_STRINGS}")
    for string in strings:
        if not string:
            raise InvalidRequestError(field, f"{what} must not be empty")
        if len(string) > MAX_STRING_CHARS:
            raise InvalidRequestError(
                field, f"one of {len(string)} characters is over {MAX_STRING_CHARS}"
            )


def validate_prompt(
    field: str, token_ids: Sequence[int], model: ModelInfo, length_field: str | None = None
) -> None:
    """The prompt as the engine will see it; `field` is the input the client used, so a text
    that tokenizes too long is reported against `prompt`, not token ids it never sent;
    `length_field`, where another field set the prompt's length (truncate_prompt_tokens)."""
    if not token_ids:
        raise InvalidRequestError(field, "is empty (no tokens)")
    if len(token_ids) >= model.max_model_len:
        raise InvalidRequestError(
            length_field or field,
            f"{len(token_ids)} tokens leave no room to generate "
            f"(the model's length is {model.max_model_len})",
        )
    too_large = next((t for t in token_ids if t >= model.vocab_size), None)
    if too_large is not None:
        raise InvalidRequestError(
            field, f"token id {too_large} is not in the vocabulary ({model.vocab_size})"
        )


def validate_tokenize_input(text: str | None, messages: Sequence[ChatMessage]) -> None:
    if (text is None) == (not messages):
        raise InvalidRequestError("text", "give exactly one of text, messages")
    if messages:
        validate_messages(messages)
