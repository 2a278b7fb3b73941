"""From a request's constraint to an xgrammar grammar: checked at the edge, compiled later."""

from __future__ import annotations

import json
from typing import Any

from engine_svc.sampling_params import SamplingParams
from shared.errors import InvalidRequestError

_ANY_OBJECT_SCHEMA = '{"type": "object"}'


def check_constraint(params: SamplingParams) -> None:
    """Parse the constraint without a tokenizer (cheap); a bad schema, regex or grammar raises
    InvalidRequestError naming its field, before the request reaches the engine loop."""
    constraint = params.constraint
    if constraint is None:
        return
    kind, _ = constraint
    try:
        grammar_of(params)
    except InvalidRequestError:
        raise
    except Exception as error:  # xgrammar reports every parse error as a RuntimeError
        raise InvalidRequestError(kind, _short(error)) from error


def grammar_of(params: SamplingParams) -> Any:
    """The xgrammar Grammar for the request's constraint (None when unconstrained)."""
    import xgrammar as xgr  # heavy (pulls in transformers); only constrained requests pay

    if params.json_schema is not None:
        try:
            json.loads(params.json_schema)
        except ValueError as error:
            raise InvalidRequestError("json_schema", f"not valid JSON: {error}") from error
        return xgr.Grammar.from_json_schema(params.json_schema, any_whitespace=False)
    if params.json_object:
        return xgr.Grammar.from_json_schema(_ANY_OBJECT_SCHEMA, any_whitespace=False)
    if params.regex is not None:
        return xgr.Grammar.from_regex(params.regex)
    if params.choice is not None:
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return xgr.Grammar.from_ebnf(f"root ::= {literals}")
    if params.grammar is not None:
        return xgr.Grammar.from_ebnf(params.grammar)
    return None


def _short(error: Exception) -> str:
    # xgrammar prefixes messages with a timestamp and a C++ source location.
    message = str(error).strip().splitlines()[0]
    return message.split(": ", 1)[-1] if ".cc:" in message else message
