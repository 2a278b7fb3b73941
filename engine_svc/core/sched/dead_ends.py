"""Why a running request can take no next token, found as its output grows: its grammar
refused the draw or left nothing to draw (the structured-output manager's finding while it
built the step's bitmask), or its allowed_token_ids, bad words and min_tokens together leave
nothing (admission checked the first token; a bad word's start can close the rest later).
Either is the request's own input's fault: the scheduler ends it naming the field, which the
gRPC APIs turn into INVALID_ARGUMENT."""

from __future__ import annotations

import dataclasses

from engine_svc.core.request import Request


@dataclasses.dataclass(frozen=True, slots=True)
class DeadEnd:
    field: str  # the request's field at fault (EngineCoreOutput.invalid_field)
    error: str


def grammar_dead_end(request: Request, token_id: int) -> DeadEnd | None:
    """Feeds the sampled token to the request's grammar: None when it takes it."""
    state = request.structured
    assert state is not None
    if state.dead_end is None and state.accept(token_id):
        return None
    return _dead_end(
        request,
        constraint_field(request),
        state.dead_end or "the constraint refused the token drawn",
    )


def restriction_dead_end(request: Request, vocab_size: int) -> DeadEnd | None:
    """None while allowed_token_ids, the bad words and min_tokens leave a next token."""
    params = request.sampling_params
    refusal = params.refusal_of_every_token(
        request.num_output_tokens,
        request.output_tail(params.bad_word_span),
        request.eos_token_ids,
        vocab_size,
    )
    return None if refusal is None else _dead_end(request, *refusal)


def constraint_field(request: Request) -> str:
    constraint = request.sampling_params.constraint
    return constraint[0] if constraint is not None else "sampling_params"


def _dead_end(request: Request, field: str, why: str) -> DeadEnd:
    return DeadEnd(
        field, f"no token can follow the {request.num_output_tokens} generated so far: {why}"
    )
