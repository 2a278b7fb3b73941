"""vllm.grpc.engine.VllmEngine on the engine's port, through the stubs smg-grpc-proto ships:
what a gateway that speaks vLLM's contract sees."""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from shared.protos import engine_pb2 as epb
from tests.service_processes import SERVING, ServiceProcess, engine_stub

SERVICE = "vllm.grpc.engine.VllmEngine"


@pytest.fixture
def stub(engine: ServiceProcess) -> Iterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    with grpc.insecure_channel(engine.address) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


def generate_request(
    request_id: str, max_tokens: int, stream: bool, **sampling: object
) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id=request_id,
        tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3, 4]),
        sampling_params=vpb.SamplingParams(temperature=0, max_tokens=max_tokens, **sampling),
        stream=stream,
    )


def test_health_and_model_info(
    engine: ServiceProcess, stub: vllm_engine_pb2_grpc.VllmEngineStub, tiny_model_dir: Path
) -> None:
    assert stub.HealthCheck(vpb.HealthCheckRequest(), timeout=5).healthy
    with grpc.insecure_channel(engine.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status
    assert status == SERVING
    info = stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=5)
    assert Path(info.tokenizer_path) == tiny_model_dir.resolve()
    assert info.served_model_name == tiny_model_dir.name and info.vocab_size == 49152
    server = stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=5)
    assert server.data_parallel_size == 1 and server.uptime_seconds > 0


def test_streamed_and_whole_generate_agree(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    streamed = list(stub.Generate(generate_request("streamed", 8, stream=True), timeout=60))
    [whole] = stub.Generate(generate_request("whole", 8, stream=False), timeout=60)
    *chunks, last = streamed
    assert all(response.WhichOneof("response") == "chunk" for response in chunks)
    token_ids = [t for response in chunks for t in response.chunk.token_ids]
    assert list(last.complete.output_ids) == token_ids == list(whole.complete.output_ids)
    assert len(token_ids) == 8 and whole.complete.finish_reason == "length"
    assert whole.complete.prompt_tokens == 4 and whole.complete.completion_tokens == 8


def test_logit_bias_moves_the_tokens(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    bias = {1234: 100.0, 5678: -100.0}  # far above and far below the model's own choices
    request = generate_request("biased", 4, stream=False, logit_bias=bias)
    [whole] = stub.Generate(request, timeout=60)
    assert list(whole.complete.output_ids) == [1234] * 4


def test_prompt_logprobs_come_in_the_first_chunk_as_vllm_sends_them(
    engine: ServiceProcess, stub: vllm_engine_pb2_grpc.VllmEngineStub
) -> None:
    request = generate_request("scored", 3, stream=True, prompt_logprobs=2)
    chunks = [r.chunk for r in stub.Generate(request, timeout=60) if r.HasField("chunk")]
    assert chunks[0].HasField("input_logprobs")
    assert not any(c.HasField("input_logprobs") for c in chunks[1:])
    sent = chunks[0].input_logprobs
    assert list(sent.token_ids) == [1, 2, 3, 4]
    assert [e.HasField("value") for e in sent.token_logprobs] == [False, True, True, True]
    # The same numbers as the engine's own API gives for the same prompt.
    with grpc.insecure_channel(engine.address) as channel:
        own = engine_stub(channel).Generate(
            epb.GenerateRequest(
                prompt_token_ids=[1, 2, 3, 4],
                sampling_params=epb.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2),
            ),
            timeout=60,
        )
        [first] = [r for r in own if r.prompt_logprobs]
    assert [e.value for e in sent.token_logprobs[1:]] == [e.logprob for e in first.prompt_logprobs]
    assert [list(t.token_ids) for t in sent.top_logprobs[1:]] == [
        list(e.top_token_ids) for e in first.prompt_logprobs
    ]


def test_n_sequences_stream_with_their_index_each_as_its_own_seeded_request(
    stub: vllm_engine_pb2_grpc.VllmEngineStub,
) -> None:
    request = generate_request("n3", 6, True, n=3, seed=40, top_k=50)
    request.sampling_params.temperature = 1.0
    responses = list(stub.Generate(request, timeout=60))
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    completes = [r.complete for r in responses if r.WhichOneof("response") == "complete"]
    assert sorted(c.index for c in completes) == [0, 1, 2]
    for complete in completes:
        streamed = [t for c in chunks if c.index == complete.index for t in c.token_ids]
        assert list(complete.output_ids) == streamed and len(streamed) == 6
        # vLLM's parallel sampling: sequence i samples as a request of its own with seed + i.
        alone = generate_request(f"alone-{complete.index}", 6, False, seed=40 + complete.index)
        alone.sampling_params.temperature, alone.sampling_params.top_k = 1.0, 50
        [whole] = stub.Generate(alone, timeout=60)
        assert list(whole.complete.output_ids) == streamed
    assert len({tuple(c.output_ids) for c in completes}) > 1  # the seeds differ


def test_abort_of_an_n_request_aborts_every_sequence(
    stub: vllm_engine_pb2_grpc.VllmEngineStub, engine: ServiceProcess
) -> None:
    completes: list[vpb.GenerateComplete] = []

    def abort_after_first_chunk() -> None:
        with engine.paused():  # the sequences run only the steps they are given
            responses = stub.Generate(
                generate_request("n-abort", 900, True, n=2, ignore_eos=True), timeout=60
            )
            engine.step_while(lambda: next(responses))
            stub.Abort(vpb.AbortRequest(request_ids=["n-abort"]), timeout=5)
            rest = list(responses)  # a paused engine still takes aborts
            completes.extend(r.complete for r in rest if r.WhichOneof("response") == "complete")

    generated = engine.tokens_of_a_request_ended_while_paused(abort_after_first_chunk)
    assert sorted(c.index for c in completes) == [0, 1]
    assert all(c.finish_reason == "abort" for c in completes)
    assert sum(c.completion_tokens for c in completes) == generated < 1800


def test_abort_ends_the_stream_as_aborted(
    stub: vllm_engine_pb2_grpc.VllmEngineStub, engine: ServiceProcess
) -> None:
    lasts: list[vpb.GenerateResponse] = []
    steps: list[int] = []

    def abort_after_first_chunk() -> None:
        with engine.paused():  # the request runs only the steps it is given
            responses = stub.Generate(
                generate_request("to-abort", 900, True, ignore_eos=True), timeout=60
            )
            first: list[vpb.GenerateResponse] = []
            steps.append(engine.step_while(lambda: first.append(next(responses))))
            assert first[0].WhichOneof("response") == "chunk"
            stub.Abort(vpb.AbortRequest(request_ids=["to-abort"]), timeout=5)
            lasts.append(list(responses)[-1])  # a paused engine still takes aborts

    generated = engine.tokens_of_a_request_ended_while_paused(abort_after_first_chunk)
    last = lasts[-1]
    assert last.complete.finish_reason == "abort"
    # One token a step (the prompt fits one): the engine ran exactly the steps it was given.
    assert last.complete.completion_tokens == generated == steps[0]


def test_cancelling_the_call_aborts_the_request(
    stub: vllm_engine_pb2_grpc.VllmEngineStub, engine: ServiceProcess
) -> None:
    steps: list[int] = []

    def cancel_after_first_chunk() -> None:
        with engine.paused():  # left once the engine holds no request
            call = stub.Generate(
                generate_request("to-cancel", 900, True, ignore_eos=True), timeout=60
            )
            steps.append(engine.step_while(lambda: next(call)))
            call.cancel()

    # The engine's own count: it aborted the request after the steps it was given, one
    # token each, long before the 900 tokens it asked for.
    generated = engine.tokens_of_a_request_ended_while_paused(cancel_after_first_chunk)
    assert generated == steps[0] < 900, "the engine did not abort the cancelled request"


def test_get_tokenizer_sends_a_verifiable_archive(
    stub: vllm_engine_pb2_grpc.VllmEngineStub,
) -> None:
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    archive = b"".join(chunk.data for chunk in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(archive).hexdigest()
    assert "tokenizer.json" in zipfile.ZipFile(io.BytesIO(archive)).namelist()


def test_a_token_id_out_of_the_vocabulary_is_named_as_the_contract_names_it(
    stub: vllm_engine_pb2_grpc.VllmEngineStub,
) -> None:
    request = generate_request("oov", 8, True)
    request.tokenized.input_ids.append(49152)  # the vocabulary is 49,152 ids: one past it
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request, timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("tokenized.input_ids:"), caught.value.details()


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"top_p": 2.0}, "sampling_params.top_p"),
        ({"n": 129}, "sampling_params.n"),
        ({"n": 2, "logit_bias": {49152: 1.0}}, "sampling_params.logit_bias"),
    ],
)
def test_invalid_requests_name_the_field(
    stub: vllm_engine_pb2_grpc.VllmEngineStub, sampling: dict[str, object], field: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(generate_request("bad", 8, True, **sampling), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith(f"{field}:"), caught.value.details()


def test_flush_cache_waits_for_idle(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    # With a timeout it retries while other tests' aborted requests still hold KV blocks.
    flushed = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=20)
    assert flushed.success, flushed.message


def test_what_a_text_engine_does_not_serve_is_unimplemented_saying_why(
    engine: ServiceProcess, stub: vllm_engine_pb2_grpc.VllmEngineStub
) -> None:
    calls = {
        "Embed": lambda: stub.Embed(vpb.EmbedRequest(), timeout=5),
        "StartProfile": lambda: stub.StartProfile(common_pb2.StartProfileRequest(), timeout=5),
        "StopProfile": lambda: stub.StopProfile(common_pb2.StopProfileRequest(), timeout=5),
        "SubscribeKvEvents": lambda: list(
            stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=5)
        ),
    }
    for method, call in calls.items():
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED, method
        assert (caught.value.details() or "").startswith(f"{method}: this engine "), method
        counted = engine.metric_total_reaching(  # smg's tests on this engine subscribe too
            "grpc_server_handled_total", 1, grpc_method=method, grpc_code="Unimplemented"
        )
        assert counted >= 1, method
    assert "NotImplementedError" not in engine.log_path.read_text()
