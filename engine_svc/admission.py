"""A request is checked once, where it enters the engine: by the client that hands it to an
engine core (the gRPC service's, the offline LLM's), against the limits that engine resolved
at start-up. The core then trusts the typed request it is given and checks nothing again.

A request that could never finish is refused here, naming the field: sampling parameters out
of range, a constraint that does not parse, an empty prompt or unknown token ids (in the
prompt, stop_token_ids, logit_bias, allowed_token_ids or bad words), allowed tokens that the bad
words or min_tokens leave none of, a prompt and max_tokens (or min_tokens) that do not
fit the model length or the KV cache.
"""

from __future__ import annotations

from engine_svc.control_messages import EngineInfo
from engine_svc.core.kv_cache.sizing import blocks_per_request
from engine_svc.messages import EngineCoreRequest
from engine_svc.structured.grammars import check_constraint
from shared.errors import InvalidRequestError


def check_request(request: EngineCoreRequest, limits: EngineInfo) -> None:
    """Raise InvalidRequestError, naming the field, unless `request` can run to its end."""
    params = request.sampling_params
    params.validate()
    check_constraint(params)
    if params.bad_words:
        raise InvalidRequestError(
            "bad_words", "the engine takes token ids (bad_words_token_ids): LLM tokenizes words"
        )
    prompt = request.prompt_token_ids
    num_prompt = len(prompt)
    if not prompt:
        raise InvalidRequestError("prompt_token_ids", "must not be empty")
    if not all(0 <= t < limits.vocab_size for t in prompt):
        raise InvalidRequestError(
            "prompt_token_ids", f"token ids must be in [0, {limits.vocab_size})"
        )
    # The sampler indexes the logits with these while min_tokens holds them back.
    outside = next((t for t in params.stop_token_ids if t >= limits.vocab_size), None)
    if outside is not None:
        raise InvalidRequestError(
            "stop_token_ids", f"token id {outside} is not in [0, {limits.vocab_size})"
        )
    # The sampler indexes the logits with these too.
    biased = next((t for t in params.logit_bias or () if t >= limits.vocab_size), None)
    if biased is not None:
        raise InvalidRequestError(
            "logit_bias", f"token id {biased} is not in [0, {limits.vocab_size})"
        )
    for field, token_ids in (
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("bad_words_token_ids", (t for word in params.bad_words_token_ids or () for t in word)),
    ):
        outside = next((t for t in token_ids if t >= limits.vocab_size), None)
        if outside is not None:
            raise InvalidRequestError(
                field, f"token id {outside} is not in [0, {limits.vocab_size})"
            )
    held_back = params.ending_token_ids(limits.eos_token_ids)
    if params.min_tokens > 0 and len(held_back) >= limits.vocab_size:
        raise InvalidRequestError(
            "stop_token_ids",
            "with these and EOS held back until min_tokens, no token is left to sample",
        )
    # The first token: later ones are checked as the output grows (the scheduler).
    refusal = params.refusal_of_every_token(0, [], limits.eos_token_ids, limits.vocab_size)
    if refusal is not None:
        raise InvalidRequestError(*refusal)
    if num_prompt >= limits.max_model_len:
        raise InvalidRequestError(
            "prompt_token_ids",
            f"{num_prompt} tokens leave no room to generate within "
            f"max_model_len={limits.max_model_len}",
        )
    if params.max_tokens is None:
        room = limits.max_model_len - num_prompt
        if params.min_tokens > room:
            raise InvalidRequestError(
                "min_tokens",
                f"{params.min_tokens} is more than the {room} tokens the prompt "
                f"({num_prompt}) leaves within max_model_len={limits.max_model_len}",
            )
        return
    total = num_prompt + params.max_tokens
    if total > limits.max_model_len:
        raise InvalidRequestError(
            "max_tokens",
            f"prompt ({num_prompt}) + max_tokens ({params.max_tokens}) = {total} exceeds "
            f"max_model_len={limits.max_model_len}",
        )
    needed = blocks_per_request(
        total, limits.block_size, limits.attention_span, limits.max_num_batched_tokens
    )
    if needed > limits.num_kv_blocks:
        raise InvalidRequestError(
            "max_tokens",
            f"{total} tokens need more KV blocks than the {limits.num_kv_blocks} that exist",
        )
