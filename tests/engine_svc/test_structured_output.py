"""Structured output: sampled text always obeys its JSON schema, regex, choice, EBNF grammar or
structural tag, and the unconstrained requests of the same batch are untouched."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine_svc import LLM, SamplingParams
from engine_svc.server.convert import proto_field_names, to_sampling_params
from shared.errors import InvalidRequestError
from shared.protos import engine_pb2 as pb
from tests.engine_svc.engine_helpers import assert_kv_cache_clean

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
CHOICES = ["apple", "banana", "cherry pie", "durian"]
# xgrammar's EBNF (GBNF): one or two pets, each a colour, a space and an animal.
GRAMMAR = '''root ::= pet (", " pet)?
pet ::= colour " " animal
colour ::= "red" | "green" | "blue"
animal ::= "cat" | "dog"'''
GRAMMAR_LANGUAGE = r"(red|green|blue) (cat|dog)(, (red|green|blue) (cat|dog))?"
# A tool call as a structural tag: free text, except that what follows the trigger is the tag
# (vLLM's format); xgrammar's format can also demand exactly one call and nothing else.
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
CALL = {"begin": "<function=get_weather>", "schema": CITY_SCHEMA, "end": "</function>"}
VLLM_TAG = json.dumps({"structures": [CALL], "triggers": ["<function="]})
ONE_CALL_TAG = json.dumps(
    {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<function="],
            "tags": [
                {
                    "type": "tag",
                    "begin": CALL["begin"],
                    "content": {"type": "json_schema", "json_schema": CITY_SCHEMA},
                    "end": CALL["end"],
                }
            ],
            "at_least_one": True,
            "stop_after_first": True,
        },
    }
)


@pytest.fixture(scope="module")
def default_llm(default_model_dir: Path) -> LLM:
    return LLM(str(default_model_dir), max_model_len=1024, num_kv_blocks=512)


def _chat(llm: LLM, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return str(
        llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )


@pytest.mark.default_model
def test_json_schema_outputs_always_validate(default_llm: LLM) -> None:
    prompt = _chat(default_llm, "Describe a person as JSON with a name, an age and a color.")
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=160, json_schema=json.dumps(PERSON_SCHEMA)
        )
        for i in range(20)
    ]
    for output in default_llm.generate([prompt] * 20, params):
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), PERSON_SCHEMA)
    assert_kv_cache_clean(default_llm)


@pytest.mark.default_model
def test_structural_tags_shape_the_tool_calls(default_llm: LLM) -> None:
    prompt = _chat(
        default_llm,
        'What is the weather in Paris? Answer with <function=get_weather>{"city": ...}</function>',
    )
    forced = default_llm.generate(
        [prompt] * 6,
        [
            SamplingParams(temperature=1.0, seed=i, max_tokens=60, structural_tag=ONE_CALL_TAG)
            for i in range(6)
        ],
    )
    for output in forced:
        call = re.fullmatch(r"<function=get_weather>(.*)</function>", output.text, re.DOTALL)
        assert call and output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(call[1]), CITY_SCHEMA)
    free = default_llm.generate(
        [prompt] * 6,
        [
            SamplingParams(temperature=1.0, seed=i, max_tokens=80, structural_tag=VLLM_TAG)
            for i in range(6)
        ],
    )
    for output in free:
        # Wherever the trigger appears, a whole call follows (unless max_tokens cut it).
        for start in (m.start() for m in re.finditer("<function=", output.text)):
            call = re.match(
                r"<function=get_weather>(.*?)</function>", output.text[start:], re.DOTALL
            )
            if call is None:
                assert output.finish_reason == "length", output.text
                continue
            jsonschema.validate(json.loads(call[1]), CITY_SCHEMA)
    assert_kv_cache_clean(default_llm)


@pytest.mark.default_model
def test_regex_and_choice_always_match(default_llm: LLM) -> None:
    prompt = _chat(default_llm, "Give me a phone number, then your favourite fruit.")
    phones = default_llm.generate(
        [prompt] * 10,
        [
            SamplingParams(temperature=1.0, seed=i, max_tokens=20, regex="[0-9]{3}-[0-9]{4}")
            for i in range(10)
        ],
    )
    assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", o.text) for o in phones), [o.text for o in phones]
    fruits = default_llm.generate(
        [prompt] * 10,
        [SamplingParams(temperature=1.0, seed=i, max_tokens=20, choice=CHOICES) for i in range(10)],
    )
    assert all(o.text in CHOICES and o.finish_reason == "stop" for o in fruits)
    pets = default_llm.generate(
        [_chat(default_llm, "Name some pets with their colour.")] * 10,
        [
            SamplingParams(temperature=1.0, seed=i, max_tokens=40, grammar=GRAMMAR)
            for i in range(10)
        ],
    )
    assert all(o.finish_reason == "stop" for o in pets)  # the grammar's sentences are short
    assert all(re.fullmatch(GRAMMAR_LANGUAGE, o.text) for o in pets), [o.text for o in pets]
    objects = default_llm.generate(
        [prompt] * 3, SamplingParams(temperature=1.0, max_tokens=60, json_object=True)
    )
    for output in objects:
        if output.finish_reason == "stop":
            assert isinstance(json.loads(output.text), dict)
    assert_kv_cache_clean(default_llm)


def test_constraints_leave_unconstrained_requests_alone(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=512)
    prompts = [llm.tokenizer.encode(f"prompt number {i} about things") for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [o.token_ids for o in llm.generate(prompts, greedy)]
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=24, regex="[a-z]{5,30}"),
        SamplingParams(temperature=0.7, max_tokens=24, json_schema=json.dumps(PERSON_SCHEMA)),
        SamplingParams(temperature=0.0, max_tokens=24, choice=CHOICES),
        SamplingParams(temperature=0.5, seed=1, max_tokens=24, grammar=GRAMMAR),
    ]
    mixed = llm.generate(prompts + prompts[:4], [greedy] * 6 + constrained)
    assert [o.token_ids for o in mixed[:6]] == alone
    assert re.fullmatch("[a-z]{5,30}", mixed[6].text)
    assert mixed[8].text in CHOICES
    assert re.fullmatch(GRAMMAR_LANGUAGE, mixed[9].text), mixed[9].text
    assert_kv_cache_clean(llm)


def test_each_grammar_compiles_once(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=8, choice=CHOICES)
    llm.generate(["a", "b", "c"], params)
    llm.generate(["d"], params)
    assert llm.engine_core.structured_output.compiler.num_grammars == 1


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": '{"type": "nonsense"}'}, "json_schema"),
        ({"regex": "[0-9"}, "regex"),
        ({"choice": []}, "choice"),
        ({"regex": "a", "json_object": True}, "regex"),
        ({"grammar": "root ::= (unclosed"}, "grammar"),
        ({"grammar": 'start ::= "a"'}, "grammar"),  # no rule `root`
        ({"grammar": 'root ::= "a"', "regex": "a"}, "grammar"),
        ({"structural_tag": "{nope"}, "structural_tag"),
        (
            {"structural_tag": '{"structures": [{"begin": "a"}], "triggers": ["a"]}'},
            "structural_tag",
        ),
        (
            {"structural_tag": '{"type": "structural_tag", "format": {"type": "?"}}'},
            "structural_tag",
        ),
    ],
)
def test_invalid_constraints_name_their_field(
    tiny_model_dir: Path, options: dict, field: str
) -> None:
    from engine_svc.structured.grammars import check_constraint

    params = SamplingParams(**options)
    with pytest.raises(InvalidRequestError) as excinfo:  # as admission checks them
        params.validate()
        check_constraint(params)
    assert excinfo.value.field == field


def test_service_refuses_bad_grammars_before_the_engine() -> None:
    from engine_svc.structured.grammars import check_constraint

    bad = to_sampling_params(pb.SamplingParams(regex="(unclosed"))
    # The service's engine client admits it in the server process, fields named as sent.
    with pytest.raises(InvalidRequestError) as excinfo, proto_field_names():
        check_constraint(bad)
    assert excinfo.value.field == "sampling_params.regex"
    good = to_sampling_params(pb.SamplingParams(choice=pb.ChoiceConstraint(choices=CHOICES)))
    assert good.choice == CHOICES


# A regex whose language is empty, and a schema whose only objects nest forever: the first
# allows no token at all, the second none once its prefix `{"a": {"a": ...` runs out of room.
EMPTY_REGEX = r"[^\s\S]"
ENDLESS_SCHEMA = json.dumps(
    {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_constraint_no_token_can_continue_ends_its_request_naming_the_field(
    tiny_model_dir: Path, temperature: float
) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=256)
    prompts = [llm.tokenizer.encode(f"prompt number {i}") for i in range(3)]
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    sampled = {"temperature": temperature, "top_p": 0.9, "seed": 3, "max_tokens": 64}
    empty = SamplingParams(regex=EMPTY_REGEX, **sampled)
    endless = SamplingParams(json_schema=ENDLESS_SCHEMA, **sampled)
    alone = llm.generate(prompts[:1], plain)[0].token_ids

    outputs = llm.generate(prompts, [plain, empty, endless])

    assert outputs[0].token_ids == alone
    for output in outputs[1:]:
        assert output.finish_reason == "error"
        assert output.error is not None and "constraint cannot be completed" in output.error
    assert outputs[1].token_ids == []
    # What it did give is the schema's own prefix: no forbidden token was kept.
    assert outputs[2].text.startswith('{"a":')
    assert_kv_cache_clean(llm)


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 5}, {"temperature": 1.0, "seed": 5}],
)
def test_a_constraint_that_only_min_tokens_blocks_ends_its_request_naming_the_field(
    tiny_model_dir: Path, sampling: dict[str, float]
) -> None:
    # Once "yes" or "no" is out, the grammar allows EOS alone, which min_tokens holds back:
    # the step has nothing to draw from, on every sampling path.
    llm = LLM(str(tiny_model_dir), max_model_len=256)
    params = SamplingParams(max_tokens=16, min_tokens=8, choice=["yes", "no"], **sampling)

    (output,) = llm.generate(["Answer:"], params)

    assert output.finish_reason == "error" and output.text in ("yes", "no")
    assert (
        output.error is not None and "no token that min_tokens, allowed_token_ids" in output.error
    )
    assert_kv_cache_clean(llm)


def test_a_constraint_keeps_to_allowed_token_ids_and_ends_where_they_share_no_token(
    tiny_model_dir: Path,
) -> None:
    """The grammar's mask and allowed_token_ids both apply: with the tokens of "no" allowed
    and EOS (which completes the choice), the choice is "no"; with none of either answer's
    tokens, none can start it."""
    llm = LLM(str(tiny_model_dir), max_model_len=256)
    eos = llm.tokenizer.eos_token_id
    choice: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8, "choice": ["yes", "no"]}
    answer_no = SamplingParams(**choice, allowed_token_ids=[*llm.tokenizer.encode("no"), eos])
    neither = SamplingParams(**choice, allowed_token_ids=[*llm.tokenizer.encode("maybe"), eos])

    no, stuck = llm.generate(["Answer:", "Answer:"], [answer_no, neither])

    assert (no.text, no.finish_reason) == ("no", "stop")
    assert stuck.finish_reason == "error" and stuck.token_ids == []
    assert stuck.error is not None and "allowed_token_ids" in stuck.error
    assert_kv_cache_clean(llm)
