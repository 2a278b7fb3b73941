"""grpcurl, the generic gRPC client, drives both services by reflection alone, with JSON:
no .proto files on the client side."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from tests.interop.processes import BIN_DIR
from tests.service_processes import FrontendProcess, ServiceProcess

PROMPT = "The capital of France is"


def grpcurl(address: str, *args: str, data: dict[str, Any] | None = None) -> list[Any]:
    """Run grpcurl against `address`; its output parsed as a sequence of JSON documents
    (one per streamed response, fields named as in the .proto), or its lines for `list`
    and `describe`."""
    command = [str(BIN_DIR / "grpcurl"), "-plaintext", "-max-time", "60"]
    if data is not None:
        command += ["-d", json.dumps(data)]
    done = subprocess.run(
        [*command, address, *args], capture_output=True, text=True, timeout=90, check=False
    )
    assert done.returncode == 0, f"grpcurl {args} failed:\n{done.stderr}"
    if args[0] in ("list", "describe"):
        return done.stdout.split("\n")
    return _json_documents(done.stdout)


def _json_documents(text: str) -> list[Any]:
    decoder = json.JSONDecoder()
    documents, position = [], 0
    while position < len(text.rstrip()):
        document, end = decoder.raw_decode(text, position)
        documents.append(document)
        position = end
        while position < len(text) and text[position].isspace():
            position += 1
    return documents


def test_reflection_lists_each_service(engine: ServiceProcess, frontend: FrontendProcess) -> None:
    engine_services = set(grpcurl(engine.address, "list"))
    assert {
        "engine.v1.EngineCoreService",
        "vllm.grpc.engine.VllmEngine",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= engine_services
    assert "frontend.v1.GenerationService" in set(grpcurl(frontend.address, "list"))
    # The VllmEngine descriptors (and common.proto, which they import) come by reflection.
    described = "\n".join(grpcurl(engine.address, "describe", "vllm.grpc.engine.VllmEngine"))
    assert "rpc Generate ( .vllm.grpc.engine.GenerateRequest )" in described
    assert "rpc GetTokenizer ( .smg.grpc.common.GetTokenizerRequest )" in described


def test_generate_stream_with_json(frontend: FrontendProcess) -> None:
    request = {"prompt": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 8}}
    method = "frontend.v1.GenerationService/GenerateStream"
    responses = grpcurl(frontend.address, method, data=request)
    choices = [choice for response in responses for choice in response.get("choices", [])]
    # How many messages carry the 8 tokens depends on timing (the frontend merges outputs
    # that queued while the stream was busy: one message when the engine is quicker), so it
    # is not checked; usage comes once, last.
    has_usage = ["usage" in response for response in responses]
    assert has_usage == [False] * (len(responses) - 1) + [True]
    assert choices[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert responses[-1]["usage"]["completion_tokens"] == 8
    streamed = "".join(choice.get("text", "") for choice in choices)
    [whole] = grpcurl(frontend.address, "frontend.v1.GenerationService/Generate", data=request)
    assert streamed == whole["choices"][0]["text"] and streamed


def test_logit_bias_in_json(frontend: FrontendProcess) -> None:
    # proto3 JSON writes a map's integer keys as strings, as OpenAI's logit_bias does.
    sampling = {"temperature": 0, "max_tokens": 4, "logit_bias": {"1234": 100}}
    request = {"prompt": PROMPT, "sampling_params": sampling}
    [whole] = grpcurl(frontend.address, "frontend.v1.GenerationService/Generate", data=request)
    assert whole["choices"][0]["token_ids"] == [1234] * 4


def engine_generate(engine: ServiceProcess, prompt: list[int], max_tokens: int) -> list[int]:
    request = {
        "prompt_token_ids": prompt,
        "sampling_params": {"temperature": 0, "max_tokens": max_tokens},
    }
    responses = grpcurl(engine.address, "engine.v1.EngineCoreService/Generate", data=request)
    assert responses[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    return [t for response in responses for t in response.get("token_ids", [])]


def test_engine_generate_with_json(engine: ServiceProcess) -> None:
    assert len(engine_generate(engine, [1, 2, 3], 6)) == 6


def test_vllm_engine_generate_with_json(engine: ServiceProcess) -> None:
    request = {
        "request_id": "grpcurl-vllm",
        "tokenized": {"input_ids": [1, 2, 3]},
        "sampling_params": {"temperature": 0, "max_tokens": 6},
        "stream": True,
    }
    responses = grpcurl(engine.address, "vllm.grpc.engine.VllmEngine/Generate", data=request)
    *chunks, last = responses
    streamed = [t for chunk in chunks for t in chunk["chunk"]["token_ids"]]
    assert streamed == engine_generate(engine, [1, 2, 3], 6)  # one engine, two contracts
    assert last["complete"]["output_ids"] == streamed
    assert last["complete"]["finish_reason"] == "length"
    assert last["complete"]["completion_tokens"] == 6
