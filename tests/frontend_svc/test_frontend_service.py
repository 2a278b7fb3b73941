"""The frontend and the engine as subprocesses with the tiny model (started once): greedy text
equals Hugging Face generate + decode, streams join to the unary text, stop strings cut
exactly and abort the engine request, n > 1, chat, and two frontends agree."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from frontend_svc.tokenizer import Tokenizer
from shared.bad_words import bad_words_token_ids
from shared.frontend_protos import frontend_pb2 as pb
from tests.engine_svc.hf_reference import hf_greedy, load_hf_model
from tests.engine_svc.test_structured_output import ENDLESS_SCHEMA, GRAMMAR, GRAMMAR_LANGUAGE
from tests.frontend_svc.frontend_helpers import frontend_stub, greedy, stream_texts
from tests.service_processes import (
    SERVING,
    FrontendProcess,
    ServiceProcess,
    frozen_at_start,
    run_async,
    wait_all_serving,
)

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Emoji time: 😀🎉👍🏽 and 🇫🇷",
    "中文测试：你好，世界",  # noqa: RUF001
    "日本語のテキストです。",
    "한국어 문장입니다",
    "Mixed 😀 中文 and English",
    "1, 2, 3, 4,",
    "café naïve résumé",
    "   leading spaces",
    "<html><body>",
    "Q: What is 2+2?\nA:",
    "The quick brown fox",
    "🙂",
    "Ω≈ç√∫",
]
MAX_TOKENS = [8 + (7 * i) % 25 for i in range(len(PROMPTS))]
EOS_OR_LENGTH = (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
# What a stopped or cancelled request asks for (the tiny model's length is 1,024): the engine's
# own count must show it aborted long before.
LONG_REQUEST_TOKENS = 1000


class Services:
    def __init__(self, engine: ServiceProcess, fetching: FrontendProcess, local: FrontendProcess):
        self.engine = engine
        self.frontend = fetching  # tokenizer fetched with the engine's GetTokenizer
        self.second_frontend = local  # tokenizer from --tokenizer


@pytest.fixture(scope="module")
def services(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    logs = tmp_path_factory.mktemp("frontend-service")
    engine = ServiceProcess(tiny_model_dir, logs / "engine.log")
    fetching = FrontendProcess([engine.address], logs / "frontend-a.log")
    local = FrontendProcess(
        [engine.address], logs / "frontend-b.log", "--tokenizer", str(tiny_model_dir)
    )
    wait_all_serving([engine, fetching, local])
    yield Services(engine, fetching, local)
    for process in (fetching, local, engine):
        process.stop()


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    return load_hf_model(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


def generate_all(address: str, requests: list[pb.GenerateRequest]) -> list[pb.GenerateResponse]:
    async def body() -> list[pb.GenerateResponse]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = frontend_stub(channel)
            return list(await asyncio.gather(*(stub.Generate(r, timeout=60) for r in requests)))

    return list(run_async(body))


def prompt_requests(**sampling: Any) -> list[pb.GenerateRequest]:
    return [
        pb.GenerateRequest(prompt=p, sampling_params=greedy(m, **sampling))
        for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]


def test_each_service_freezes_its_start_up_heap(services: Services) -> None:
    for frontend in (services.frontend, services.second_frontend):
        assert frozen_at_start(frontend.log_path, "the frontend") > 10_000
    assert frozen_at_start(services.engine.log_path, "engine core 0") > 10_000


def test_greedy_text_equals_hf_generate_and_decode_and_streams_join_to_it(
    services: Services, hf: tuple[Any, Any]
) -> None:
    model, tokenizer = hf
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    expected_ids = hf_greedy(model, prompt_ids, MAX_TOKENS)
    expected_texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected_ids]

    responses = generate_all(services.frontend.address, prompt_requests())
    assert [list(r.choices[0].token_ids) for r in responses] == expected_ids
    assert [r.choices[0].text for r in responses] == expected_texts
    assert all(r.choices[0].finish_reason in EOS_OR_LENGTH for r in responses)
    assert [r.usage.prompt_tokens for r in responses] == [len(ids) for ids in prompt_ids]
    assert [r.usage.completion_tokens for r in responses] == [len(ids) for ids in expected_ids]

    async def streams() -> list[tuple[list[str], list[int], list[pb.GenerateResponse]]]:
        async with grpc.aio.insecure_channel(services.frontend.address) as channel:
            stub = frontend_stub(channel)
            return list(await asyncio.gather(*(stream_texts(stub, r) for r in prompt_requests())))

    results = zip(run_async(streams), expected_texts, expected_ids, strict=True)
    for (deltas, token_ids, messages), text, ids in results:
        assert "".join(deltas) == text
        assert token_ids == ids
        # Mid-stream deltas never end inside a character; usage comes last, once.
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])
        assert [m.HasField("usage") for m in messages] == [False] * (len(messages) - 1) + [True]


def test_two_frontends_on_one_engine_give_identical_results(services: Services) -> None:
    requests = prompt_requests()
    sampled = pb.GenerateRequest(
        prompt="Tell me a story",
        sampling_params=pb.SamplingParams(max_tokens=24, temperature=0.9, seed=42, n=2),
    )
    first = generate_all(services.frontend.address, [*requests, sampled])
    second = generate_all(services.second_frontend.address, [*requests, sampled])
    assert [[(c.text, list(c.token_ids)) for c in r.choices] for r in first] == [
        [(c.text, list(c.token_ids)) for c in r.choices] for r in second
    ]


def _stop_spanning_two_tokens(tokenizer: Any, token_ids: list[int]) -> tuple[str, int]:
    """A stop string made of the end of one token's text and the start of the next's, whose
    first occurrence is there; and the number of tokens up to the completing one."""
    texts = [
        tokenizer.decode(token_ids[:k], skip_special_tokens=True) for k in range(len(token_ids) + 1)
    ]
    for k in range(2, len(token_ids) - 1):
        first, second = texts[k][len(texts[k - 1]) :], texts[k + 1][len(texts[k]) :]
        if len(first.strip()) < 2 or len(second.strip()) < 2 or "\ufffd" in texts[k + 1]:
            continue
        stop = first[-2:] + second[:2]
        if texts[k + 1].find(stop) == len(texts[k]) - 2:
            return stop, k + 1
    raise AssertionError("no two neighbouring tokens to span")


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_a_stop_string_across_two_tokens_cuts_exactly_and_the_engine_aborts(
    services: Services, hf: tuple[Any, Any], include_stop_str_in_output: bool
) -> None:
    _, tokenizer = hf
    prompt = "A stop string test: the quick brown fox"
    reference = generate_all(
        services.frontend.address,
        [pb.GenerateRequest(prompt=prompt, sampling_params=greedy(40, ignore_eos=True))],
    )[0].choices[0]
    stop, num_tokens = _stop_spanning_two_tokens(tokenizer, list(reference.token_ids))
    cut = reference.text.index(stop) + (len(stop) if include_stop_str_in_output else 0)
    params = greedy(
        LONG_REQUEST_TOKENS, ignore_eos=True, stop=["never appears", stop],
        include_stop_str_in_output=include_stop_str_in_output,
    )  # fmt: skip

    choices: list[pb.Choice] = []
    steps: list[int] = []
    engine = services.engine

    async def stopped() -> None:
        # The request arrives at a paused engine, which then runs a step at a time until
        # the frontend, seeing the stop string, has aborted it.
        await asyncio.to_thread(engine.pause)
        try:
            async with grpc.aio.insecure_channel(services.frontend.address) as channel:
                request = pb.GenerateRequest(prompt=prompt, sampling_params=params)
                call = asyncio.ensure_future(frontend_stub(channel).Generate(request, timeout=60))
                deadline = asyncio.get_running_loop().time() + 30
                while await asyncio.to_thread(engine.num_requests) == 0:
                    assert asyncio.get_running_loop().time() < deadline, "never reached the engine"
                    await asyncio.sleep(0.01)
                steps.append(await asyncio.to_thread(engine.generate_in_steps_until_idle))
                response = await call
        finally:
            await asyncio.to_thread(engine.resume)
        choices.append(response.choices[0])

    generated = engine.tokens_of_a_request_ended_while_paused(lambda: run_async(stopped))
    choice = choices[-1]
    assert choice.text == reference.text[:cut]
    assert list(choice.token_ids) == list(reference.token_ids[:num_tokens])
    assert (choice.finish_reason, choice.stop_string) == (pb.FINISH_REASON_STOP, stop)
    # One token a step (the prompt fits one), but the frontend's abort may land during the
    # forward after the one that showed the stop string, which then drops its token.
    assert steps[-1] - 1 <= generated <= steps[-1] < LONG_REQUEST_TOKENS


def test_cancelling_a_stream_aborts_the_engine_request(services: Services) -> None:
    engine = services.engine

    steps: list[int] = []

    async def cancelled() -> None:
        # Paused, the engine runs the request only the steps it is given: it is mid-stream
        # when the cancel reaches it, however slowly this test runs.
        await asyncio.to_thread(engine.pause)
        try:
            async with grpc.aio.insecure_channel(services.frontend.address) as channel:
                request = pb.GenerateRequest(
                    prompt="Cancel me", sampling_params=greedy(LONG_REQUEST_TOKENS, ignore_eos=True)
                )
                call = frontend_stub(channel).GenerateStream(request)
                first = asyncio.ensure_future(call.read())
                got_first = threading.Event()
                first.add_done_callback(lambda _: got_first.set())
                steps.append(
                    await asyncio.to_thread(engine.step_until, lambda: got_first.wait(0.2))
                )
                assert (await first).choices[0].token_ids
                call.cancel()
                await asyncio.to_thread(engine.wait_idle, 30.0)
        finally:
            await asyncio.to_thread(engine.resume)

    generated = engine.tokens_of_a_request_ended_while_paused(lambda: run_async(cancelled))
    # One token a step: the engine ran exactly the steps it was given, then the abort came.
    assert generated == steps[0] < LONG_REQUEST_TOKENS, "the engine did not abort the request"


def test_n_choices_use_consecutive_seeds_and_share_the_prompt_blocks(services: Services) -> None:
    prompt = "Sharing a prompt among three choices, long enough to fill a few KV blocks: " * 2
    params = {"max_tokens": 12, "temperature": 1.0}
    requests = [
        pb.GenerateRequest(prompt=prompt, sampling_params=pb.SamplingParams(n=3, seed=7, **params))
    ]
    requests += [
        pb.GenerateRequest(prompt=prompt, sampling_params=pb.SamplingParams(seed=7 + i, **params))
        for i in range(3)
    ]
    together, *alone = generate_all(services.frontend.address, requests)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [r.choices[0].text for r in alone]
    assert len({c.text for c in together.choices}) > 1
    usage = together.usage
    assert usage.completion_tokens == sum(len(c.token_ids) for c in together.choices)
    assert 0 < usage.cached_tokens < usage.prompt_tokens


def test_logprobs_come_with_each_token(services: Services) -> None:
    request = pb.GenerateRequest(prompt="Logprobs", sampling_params=greedy(6, logprobs=2))
    choice = generate_all(services.frontend.address, [request])[0].choices[0]
    assert [lp.token_id for lp in choice.logprobs] == list(choice.token_ids)
    assert all(len(lp.top_token_ids) == len(lp.top_logprobs) == 2 for lp in choice.logprobs)
    assert all(lp.rank == 1 and lp.logprob <= 0 for lp in choice.logprobs)  # greedy


def test_logit_bias_reaches_the_engine_for_every_choice(services: Services) -> None:
    # +100 on one token makes it every greedy choice, whatever the model says; the logprobs
    # stay the model's own (the biased token is not its top one).
    params = greedy(5, logprobs=1, n=2, logit_bias={1234: 100.0}, ignore_eos=True)
    request = pb.GenerateRequest(prompt="Logit bias", sampling_params=params)
    response = generate_all(services.frontend.address, [request])[0]
    assert [list(c.token_ids) for c in response.choices] == [[1234] * 5] * 2
    assert all(lp.rank > 1 for c in response.choices for lp in c.logprobs)


def test_allowed_token_ids_and_bad_words_reach_the_engine_for_every_choice(
    services: Services, tokenizer: Tokenizer
) -> None:
    allowed = [1234, 2345, 3456]
    sampled = pb.SamplingParams(
        temperature=1.0, seed=7, n=3, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed
    )
    # Ban the first word the model says, by its text: the frontend tokenizes it for the
    # engine, as it begins a text and after a space.
    prompt = list(range(200, 240))
    plain = greedy(6, ignore_eos=True)
    first = (
        generate_all(
            services.frontend.address,
            [pb.GenerateRequest(prompt_token_ids=prompt, sampling_params=plain)],
        )[0]
        .choices[0]
        .token_ids[0]
    )
    word = tokenizer.decode([first], skip_special_tokens=True)
    banned = greedy(6, ignore_eos=True, n=2, bad_words=[word])
    restricted, unbanned = generate_all(
        services.frontend.address,
        [
            pb.GenerateRequest(prompt="Allowed", sampling_params=sampled),
            pb.GenerateRequest(prompt_token_ids=prompt, sampling_params=banned),
        ],
    )
    assert len(restricted.choices) == 3
    assert all(set(c.token_ids) <= set(allowed) for c in restricted.choices)
    sequences = bad_words_token_ids(
        lambda text: tokenizer.encode(text, add_special_tokens=False), [word]
    )
    assert (first,) in sequences
    for choice in unbanned.choices:
        tokens = list(choice.token_ids)
        assert len(tokens) == 6 and tokens[0] != first
        for sequence in sequences:
            n = len(sequence)
            assert all(tuple(tokens[i : i + n]) != sequence for i in range(len(tokens) - n + 1))


def test_prompt_logprobs_come_once_and_equal_hf(services: Services, hf: tuple[Any, Any]) -> None:
    import torch

    model, tokenizer = hf
    text = "Prompt logprobs, for scoring a text"
    prompt = tokenizer(text).input_ids
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    params = greedy(4, prompt_logprobs=3, n=2, ignore_eos=True)
    request = pb.GenerateRequest(prompt=text, sampling_params=params)
    queries = "vllm:prefix_cache_queries_total"
    before = services.engine.metric_total(queries)
    whole = generate_all(services.frontend.address, [request])[0]
    # Both choices share the prompt: only choice 0's engine request computes its logprobs
    # (past the prefix cache); choice 1's looks the prompt up in the cache as any other.
    after = services.engine.metric_total_reaching(queries, before + len(prompt))
    assert after == before + len(prompt)

    async def stream() -> list[pb.GenerateResponse]:
        async with grpc.aio.insecure_channel(services.frontend.address) as channel:
            return (await stream_texts(frontend_stub(channel), request))[2]

    streamed = run_async(stream)
    carrying = [r for r in streamed if r.prompt_logprobs]
    assert len(carrying) == 1 and carrying[0].choices  # once, with the first tokens
    for entries in (whole.prompt_logprobs, carrying[0].prompt_logprobs):
        assert [e.token_id for e in entries] == prompt[1:]  # the first token has none
        for position, entry in enumerate(entries):
            row = expected[position]
            assert abs(entry.logprob - row[entry.token_id].item()) < 1e-4
            assert list(entry.top_token_ids) == row.topk(3).indices.tolist()


def test_truncate_prompt_tokens_keeps_the_last_tokens(services: Services) -> None:
    prompt = list(range(100, 180))
    truncated = greedy(6, truncate_prompt_tokens=12)
    long_text = "word " * 1100  # over the tiny model's 1,024 tokens, refused without truncation
    whole, last, text = generate_all(
        services.frontend.address,
        [
            pb.GenerateRequest(prompt_token_ids=prompt, sampling_params=truncated),
            pb.GenerateRequest(prompt_token_ids=prompt[-12:], sampling_params=greedy(6)),
            pb.GenerateRequest(
                prompt=long_text, sampling_params=greedy(2, truncate_prompt_tokens=100)
            ),
        ],
    )
    assert list(whole.choices[0].token_ids) == list(last.choices[0].token_ids)
    assert whole.usage.prompt_tokens == last.usage.prompt_tokens == 12
    assert text.usage.prompt_tokens == 100


def test_an_ebnf_grammar_shapes_every_choice(services: Services) -> None:
    params = pb.SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=24, grammar=GRAMMAR)
    request = pb.GenerateRequest(prompt="Pets:", sampling_params=params)
    response = generate_all(services.frontend.address, [request])[0]
    assert len(response.choices) == 3
    for choice in response.choices:
        assert re.fullmatch(GRAMMAR_LANGUAGE, choice.text), choice.text
        assert choice.finish_reason == pb.FINISH_REASON_STOP


def test_chat_messages_use_the_chat_template(services: Services, hf: tuple[Any, Any]) -> None:
    model, tokenizer = hf
    messages = [{"role": "user", "content": "Hello! 你好 😀"}]
    expected_prompt = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    expected = hf_greedy(model, [expected_prompt], [16])[0]
    chat = [pb.ChatMessage(**m) for m in messages]
    with grpc.insecure_channel(services.frontend.address) as channel:
        stub = frontend_stub(channel)
        tokenized = stub.Tokenize(pb.TokenizeRequest(messages=chat), timeout=30)
        response = stub.Generate(
            pb.GenerateRequest(messages=chat, sampling_params=greedy(16)), timeout=60
        )
        text = stub.Tokenize(pb.TokenizeRequest(text=PROMPTS[7]), timeout=30)
    assert list(tokenized.token_ids) == expected_prompt
    assert list(response.choices[0].token_ids) == expected
    assert list(text.token_ids) == tokenizer(PROMPTS[7]).input_ids
    assert tokenizer.decode(text.token_ids) == PROMPTS[7]  # emoji and CJK round-trip


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompt"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(n=0)}, "sampling_params.n"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(temperature=-1)},
         "sampling_params.temperature"),  # checked by the engine, named the same way
        ({"prompt": "word " * 1100}, "prompt"),
        ({"prompt": "word " * 1100,  # cut to a length that still fills the model's 1024
          "sampling_params": pb.SamplingParams(truncate_prompt_tokens=1024)},
         "sampling_params.truncate_prompt_tokens"),
        ({"prompt": "word " * 1100, "sampling_params": pb.SamplingParams(
            truncate_prompt_tokens=2000)}, "prompt"),  # nothing cut: the prompt's length
        ({"prompt_token_ids": [5, 49152]}, "prompt_token_ids"),
        ({"messages": [pb.ChatMessage(role="", content="x")]}, "messages[0].role"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(logit_bias={49152: 1.0})},
         "sampling_params.logit_bias"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(logit_bias={5: -101.0})},
         "sampling_params.logit_bias"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(prompt_logprobs=21)},
         "sampling_params.prompt_logprobs"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(truncate_prompt_tokens=0)},
         "sampling_params.truncate_prompt_tokens"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(allowed_token_ids=[5, 49152])},
         "sampling_params.allowed_token_ids"),  # checked by the engine
        ({"prompt": "a", "sampling_params": pb.SamplingParams(bad_words=["ok", " "])},
         "sampling_params.bad_words"),
        # 75 tokens, over the engine's 64 a word: it names its own field, renamed the client's.
        ({"prompt": "a", "sampling_params": pb.SamplingParams(bad_words=["x" * 300])},
         "sampling_params.bad_words"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(grammar='start ::= "a"')},
         "sampling_params.grammar"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(structural_tag='{"x": 1}')},
         "sampling_params.structural_tag"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(regex="[0-9")},
         "sampling_params.regex"),  # refused by the engine's server before its busy loop
        ({"prompt": "a", "sampling_params": pb.SamplingParams(json_schema="{oops")},
         "sampling_params.json_schema"),
        # Past the vocabulary, with min_tokens: this once crashed the engine's sampler.
        ({"prompt": "a", "sampling_params": pb.SamplingParams(stop_token_ids=[49152],
                                                              min_tokens=1, max_tokens=4)},
         "sampling_params.stop_token_ids"),
        # Constraints that parse but that no token can continue, at once or after a prefix:
        # the engine ends them naming the field, and stays in service for other requests.
        ({"prompt": "a", "sampling_params": pb.SamplingParams(regex=r"[^\s\S]")},
         "sampling_params.regex"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(json_schema=ENDLESS_SCHEMA,
                                                              max_tokens=64)},
         "sampling_params.json_schema"),
    ],
)  # fmt: skip
def test_bad_input_is_invalid_argument_naming_the_field(
    services: Services, fields: dict[str, Any], field: str
) -> None:
    with grpc.insecure_channel(services.frontend.address) as channel:
        for method in ("Generate", "GenerateStream"):
            call = getattr(frontend_stub(channel), method)
            with pytest.raises(grpc.RpcError) as caught:
                result = call(pb.GenerateRequest(**fields), timeout=30)
                list(result) if method == "GenerateStream" else result
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith(f"{field}:"), caught.value.details()
    assert services.frontend.health() == SERVING  # no engine was taken out of service


def test_model_info_health_and_reflection(services: Services, tiny_model_dir: Path) -> None:
    assert services.frontend.health() == SERVING
    with grpc.insecure_channel(services.frontend.address) as channel:
        info = frontend_stub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        query = reflection_pb2.ServerReflectionRequest(list_services="")
        answer = next(iter(reflection.ServerReflectionInfo(iter([query]), timeout=5)))
    assert (info.model_name, info.max_model_len, info.vocab_size) == (
        tiny_model_dir.name,
        1024,
        49152,
    )
    assert (list(info.eos_token_ids), info.has_chat_template) == ([2], True)
    assert (info.num_engines, info.num_healthy_engines) == (1, 1)
    assert info.architecture == "LlamaForCausalLM"
    names = {s.name for s in answer.list_services_response.service}
    assert {"frontend.v1.GenerationService", "grpc.health.v1.Health"} <= names


def test_structured_output_constrains_every_choice(services: Services) -> None:
    # Bounded by construction: a random tiny model would run an unbounded integer to the limit.
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        }
    )
    constraints = {
        "regex": ({"regex": "[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{3}-[0-9]{4}", t)),
        "choice": (
            {"choice": pb.ChoiceConstraint(choices=["yes", "no", "maybe"])},
            lambda t: t in ("yes", "no", "maybe"),
        ),
        "json_schema": ({"json_schema": schema}, lambda t: isinstance(json.loads(t)["ok"], bool)),
    }
    for name, (fields, check) in constraints.items():
        params = pb.SamplingParams(temperature=1.0, seed=3, max_tokens=40, n=3, **fields)
        request = pb.GenerateRequest(prompt="Answer:", sampling_params=params)
        (response,) = generate_all(services.frontend.address, [request])
        assert len(response.choices) == 3
        for choice in response.choices:
            assert choice.finish_reason == pb.FINISH_REASON_STOP, (name, choice.text)
            assert check(choice.text), (name, choice.text)
