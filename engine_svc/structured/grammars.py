"""From a request's constraint to an xgrammar grammar: checked at the edge, compiled later."""

from __future__ import annotations

import json
from typing import Any

from engine_svc.sampling_params import SamplingParams
from shared.errors import InvalidRequestError

_ANY_OBJECT_SCHEMA = '{"type": "object"}'


def check_constraint(params: SamplingParams) -> None:
    """Parse the constraint without a tokenizer (cheap); a bad schema, regex, grammar or tag raises
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
    if params.structural_tag is not None:
        return _structural_tag_grammar(xgr, params.structural_tag)
    return None


def _structural_tag_grammar(xgr: Any, spec: str) -> Any:
    """vLLM's structural tag (a list of {begin, schema, end} structures and the triggers that
    start them), or xgrammar's own format, which the JSON's shape tells apart as vLLM does."""
    try:
        tag = json.loads(spec)
    except ValueError as error:
        raise InvalidRequestError("structural_tag", f"not valid JSON: {error}") from error
    if isinstance(tag, dict) and "structures" in tag:
        try:
            items = [
                xgr.StructuralTagItem(
                    begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
                )
                for s in tag["structures"]
            ]
            triggers = [str(t) for t in tag["triggers"]]
        except (KeyError, TypeError) as error:
            raise InvalidRequestError(
                "structural_tag",
                'needs "structures" of {"begin", "schema", "end"} and "triggers"',
            ) from error
        return xgr.Grammar.from_structural_tag(items, triggers)
    return xgr.Grammar.from_structural_tag(spec)


def _short(error: Exception) -> str:
    # xgrammar prefixes messages with a timestamp and a C++ source location.
    message = str(error).strip().splitlines()[0]
    return message.split(": ", 1)[-1] if ".cc:" in message else message
