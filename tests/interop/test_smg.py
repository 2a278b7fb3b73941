"""The OpenAI route: the `openai` client -> smg (tokenizer, chat template, detokenizer)
-> vllm.grpc.engine.VllmEngine on our engine. smg's text must be our frontend's text."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from openai import OpenAI, Stream
from openai.types.chat import ChatCompletionChunk, ChatCompletionUserMessageParam

from shared.frontend_protos import frontend_pb2 as fpb
from shared.frontend_protos import frontend_pb2_grpc
from tests.interop.processes import SmgProcess
from tests.service_processes import REPO_ROOT, FrontendProcess, ServiceProcess

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"
MESSAGES: list[ChatCompletionUserMessageParam] = [{"role": "user", "content": QUESTION}]


@pytest.fixture
def openai_client(smg: SmgProcess) -> OpenAI:
    return OpenAI(base_url=f"{smg.base_url}/v1", api_key="unused", timeout=60, max_retries=0)


def frontend_generate(frontend: FrontendProcess, **request: object) -> fpb.GenerateResponse:
    with grpc.insecure_channel(frontend.address) as channel:
        stub = frontend_pb2_grpc.GenerationServiceStub(channel)
        return stub.Generate(fpb.GenerateRequest(**request), timeout=60)  # type: ignore[arg-type]


def test_greedy_completion_matches_frontend(
    openai_client: OpenAI, frontend: FrontendProcess, model_name: str
) -> None:
    completion = openai_client.completions.create(
        model=model_name, prompt=PROMPT, temperature=0, max_tokens=16
    )
    ours = frontend_generate(
        frontend, prompt=PROMPT, sampling_params=fpb.SamplingParams(temperature=0, max_tokens=16)
    )
    [choice] = completion.choices
    assert choice.text == ours.choices[0].text and choice.text
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 16
    assert completion.usage.prompt_tokens == ours.usage.prompt_tokens


def test_n_completions_through_smg(
    openai_client: OpenAI, frontend: FrontendProcess, model_name: str
) -> None:
    # smg sends n on vLLM's contract; the engine runs n sequences and tags each by index.
    completion = openai_client.completions.create(
        model=model_name, prompt=PROMPT, temperature=0, max_tokens=8, n=3
    )
    ours = frontend_generate(
        frontend, prompt=PROMPT, sampling_params=fpb.SamplingParams(temperature=0, max_tokens=8)
    )
    assert sorted(choice.index for choice in completion.choices) == [0, 1, 2]
    assert [choice.text for choice in completion.choices] == [ours.choices[0].text] * 3
    assert completion.usage is not None and completion.usage.completion_tokens == 24


def test_streamed_chat_completion(
    openai_client: OpenAI, frontend: FrontendProcess, model_name: str
) -> None:
    stream = openai_client.chat.completions.create(
        model=model_name, messages=MESSAGES, temperature=0, max_tokens=12, stream=True
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    deltas = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices[0].delta.content]
    # How many chunks carry the 12 tokens depends on timing (outputs that queue up while a
    # stream is busy go out together), so only their content is checked.
    assert deltas and chunks[-1].choices[0].finish_reason == "length"
    # smg rendered the model's chat template itself: the same prompt as our frontend's.
    ours = frontend_generate(
        frontend,
        messages=[fpb.ChatMessage(role="user", content=QUESTION)],
        sampling_params=fpb.SamplingParams(temperature=0, max_tokens=12),
    )
    assert "".join(deltas) == ours.choices[0].text


def test_client_disconnect_aborts_the_engine_request(
    openai_client: OpenAI, engine: ServiceProcess, model_name: str
) -> None:
    streams: list[Stream[ChatCompletionChunk]] = []

    def open_and_read() -> None:
        # smg answers the call once the engine has a first token: opened in the reader too.
        stream = openai_client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_tokens=900,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streams.append(stream)
        assert len(list(itertools.islice(stream, 3))) == 3

    steps: list[int] = []

    def disconnect_mid_stream() -> None:
        with engine.paused():  # the request runs only the steps it is given
            steps.append(engine.step_while(open_and_read))
            streams[0].close()  # the client goes away mid-stream
            # smg notices a closed connection when it next writes: the engine runs a step
            # at a time until smg's abort has reached it.
            steps.append(engine.generate_in_steps_until_idle())

    # The engine's own count: it aborted the request after the steps it was given (one
    # token each; the chat prompt fits one step; smg's abort may land during a forward,
    # which then drops its token), long before the 900 tokens it asked for.
    generated = engine.tokens_of_a_request_ended_while_paused(disconnect_mid_stream)
    assert sum(steps) - 1 <= generated <= sum(steps) < 900, "the engine did not abort it"


def test_bench_openai_runs_a_workload_through_smg(
    smg: SmgProcess, engine: ServiceProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`python -m engine_svc.bench openai` against smg in front of our engine (random token
    prompts sent as their text): every request streams to its exact length (the server's own
    count), and the figures are written."""
    result = tmp_path / "result.json"
    command = [
        sys.executable, "-m", "engine_svc.bench", "openai", "--base-url", smg.base_url,
        "--model", str(tiny_model_dir), "--engine-address", engine.address,
        "--num-prompts", "4", "--input-len", "8", "--range-ratio", "0.25", "--output-len", "6",
        "--max-concurrency", "2", "--skip-ceilings", "--no-progress",
        "--result-file", str(result),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(result.read_text())
    assert summary["served_model_name"] == smg.model_name
    [run] = summary["runs"]
    assert (run["completed"], run["failed"]) == (4, 0)
    assert run["total_output_tokens"] == 4 * 6
    assert run["total_input_tokens"] > 0  # smg's count of the decoded prompts, re-tokenized
    assert 0 < run["median_ttft_ms"] <= run["median_e2el_ms"]
