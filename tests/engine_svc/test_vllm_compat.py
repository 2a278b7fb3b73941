"""vllm.grpc.engine <-> engine structs, without a server: vLLM's defaults for unset fields,
refusals that name the field (the conversion's and admission's), and the chunk-then-complete
shape smg reads."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine_svc.admission import check_request
from engine_svc.control_messages import EngineInfo
from engine_svc.messages import EngineCoreOutput, FinishReason, TokenLogprobs
from engine_svc.server.convert import proto_field_names
from engine_svc.server.vllm_compat import convert
from engine_svc.server.vllm_compat.responses import EngineRequestError, GenerateResponses
from engine_svc.server.vllm_compat.tokenizer_bundle import archive_chunks, build_archive
from shared.engine_load import RankLoad
from shared.errors import InvalidRequestError

INFO = EngineInfo(
    engine_index=0,
    max_model_len=1024,
    vocab_size=49152,
    eos_token_ids=[2],
    block_size=16,
    num_kv_blocks=100,
    max_num_seqs=8,
)


def generate_request(**sampling: object) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id="r",
        tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=vpb.SamplingParams(**sampling),
    )


def test_unset_fields_take_vllm_defaults() -> None:
    request = convert.to_engine_request(generate_request())
    params = request.sampling_params
    assert request.prompt_token_ids == [1, 2, 3]
    assert (params.temperature, params.top_p, params.repetition_penalty) == (1.0, 1.0, 1.0)
    assert params.max_tokens is None  # up to the model length, as vLLM's servicer does
    assert params.seed is None and params.logprobs is None


def test_set_fields_pass_through() -> None:
    params = convert.to_sampling_params(
        vpb.SamplingParams(
            temperature=0.0, top_p=0.5, top_k=7, max_tokens=9, min_tokens=2, seed=3,
            stop_token_ids=[5], ignore_eos=True, logprobs=2, regex="a+",
            stop=["ignored: text is the caller's"],
        )
    )  # fmt: skip
    assert params.is_greedy and params.top_p == 0.5 and params.top_k == 7
    assert (params.max_tokens, params.min_tokens, params.seed) == (9, 2, 3)
    assert params.stop_token_ids == [5] and params.ignore_eos and params.logprobs == 2
    assert params.regex == "a+"


def test_an_ebnf_grammar_and_a_structural_tag_pass_through() -> None:
    params = convert.to_sampling_params(vpb.SamplingParams(grammar='root ::= "a" | "b"'))
    assert params.grammar == 'root ::= "a" | "b"' and params.constraint is not None
    tag = '{"structures": [], "triggers": []}'
    assert convert.to_sampling_params(vpb.SamplingParams(structural_tag=tag)).structural_tag == tag


def test_logit_bias_passes_through() -> None:
    params = convert.to_sampling_params(vpb.SamplingParams(logit_bias={5: -100.0, 7: 2.5}))
    assert params.logit_bias == {5: -100.0, 7: 2.5}
    assert convert.to_sampling_params(vpb.SamplingParams()).logit_bias is None


def test_truncate_prompt_tokens_keeps_the_last_tokens() -> None:
    request = convert.to_engine_request(generate_request(truncate_prompt_tokens=2))
    assert request.prompt_token_ids == [2, 3]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (vpb.GenerateRequest(text="hello"), "tokenized"),
        (vpb.GenerateRequest(tokenized=vpb.TokenizedInput()), "tokenized.input_ids"),
        # -1 (the whole vocabulary) is over the bound, as with vLLM's default max_logprobs.
        (generate_request(prompt_logprobs=-1), "sampling_params.prompt_logprobs"),
        (generate_request(prompt_logprobs=21), "sampling_params.prompt_logprobs"),
        (generate_request(logit_bias={-5: 1.0}), "sampling_params.logit_bias"),
        (generate_request(logit_bias={49152: 1.0}), "sampling_params.logit_bias"),
        (generate_request(logit_bias={5: 100.5}), "sampling_params.logit_bias"),
        (
            generate_request(logit_bias=dict.fromkeys(range(1025), 1.0)),
            "sampling_params.logit_bias",
        ),
        (generate_request(grammar="root ::= 'a'"), "sampling_params.grammar"),  # GBNF quotes "
        (generate_request(structural_tag="{oops"), "sampling_params.structural_tag"),
        (generate_request(truncate_prompt_tokens=-1), "sampling_params.truncate_prompt_tokens"),
        (generate_request(top_p=1.5), "sampling_params.top_p"),
        (generate_request(logprobs=-1), "sampling_params.logprobs"),
        (generate_request(json_schema="{not json"), "sampling_params.json_schema"),
        (
            vpb.GenerateRequest(
                tokenized=vpb.TokenizedInput(input_ids=[1]), kv_transfer_params_json="{}"
            ),
            "kv_transfer_params",
        ),
    ],
)
def test_refusals_name_the_field(request_: vpb.GenerateRequest, field: str) -> None:
    # As the servicer does: convert, then the engine client admits, fields named as in vllm's proto.
    with pytest.raises(InvalidRequestError) as caught, proto_field_names():
        check_request(convert.to_engine_request(request_), INFO)
    assert caught.value.field == field


def output(
    tokens: list[int], finish: FinishReason | None = None, **fields: object
) -> EngineCoreOutput:
    return EngineCoreOutput(request_id="r", new_token_ids=tokens, finish_reason=finish, **fields)  # type: ignore[arg-type]


def test_stream_sends_chunks_then_a_complete_with_everything() -> None:
    responses = GenerateResponses([5, 6, 7], stream=True)
    sent = [
        *responses.on_output(output([10, 11], num_cached_tokens=2)),
        *responses.on_output(output([])),  # nothing new: nothing sent
        *responses.on_output(output([12], FinishReason.STOP, stop_reason=12)),
    ]
    kinds = [response.WhichOneof("response") for response in sent]
    assert kinds == ["chunk", "chunk", "complete"]
    assert list(sent[0].chunk.token_ids) == [10, 11] and sent[0].chunk.completion_tokens == 2
    assert sent[0].chunk.prompt_tokens == 3 and sent[0].chunk.cached_tokens == 2
    complete = sent[-1].complete
    assert list(complete.output_ids) == [10, 11, 12]
    assert complete.finish_reason == "stop" and complete.matched_token_id == 12
    assert (complete.prompt_tokens, complete.completion_tokens) == (3, 3)


def test_without_stream_only_the_complete_is_sent() -> None:
    responses = GenerateResponses([5, 6, 7], stream=False)
    assert responses.on_output(output([10])) == []
    [last] = responses.on_output(output([11], FinishReason.LENGTH))
    assert list(last.complete.output_ids) == [10, 11] and last.complete.finish_reason == "length"
    assert not last.complete.HasField("matched_token_id")


def test_logprobs_per_chunk_and_whole_on_complete() -> None:
    def logprobs(token: int) -> TokenLogprobs:
        return TokenLogprobs(token, -0.5, 1, [token, 99], [-0.5, -2.0])

    responses = GenerateResponses([5], stream=True)
    first = responses.on_output(output([10], new_logprobs=[logprobs(10)]))
    chunk, complete = responses.on_output(
        output([11], FinishReason.LENGTH, new_logprobs=[logprobs(11)])
    )
    assert list(first[0].chunk.output_logprobs.token_ids) == [10]
    assert list(chunk.chunk.output_logprobs.token_ids) == [11]
    whole = complete.complete.output_logprobs
    assert list(whole.token_ids) == [10, 11] and list(whole.token_logprobs) == [-0.5, -0.5]
    assert list(whole.top_logprobs[1].token_ids) == [11, 99]


def test_prompt_logprobs_in_the_first_chunk_and_on_complete() -> None:
    prompt = [5, 6, 7]
    entries = [TokenLogprobs(6, -1.5, 2, [9], [-0.25]), TokenLogprobs(7, -3.0, 4, [9], [-0.5])]
    responses = GenerateResponses(prompt, stream=True)
    [first] = responses.on_output(output([10], prompt_logprobs=entries))
    chunk, complete = responses.on_output(output([11], FinishReason.LENGTH))
    assert not chunk.chunk.HasField("input_logprobs")
    for sent in (first.chunk.input_logprobs, complete.complete.input_logprobs):
        # vLLM's shape: one entry per prompt token, the first without a value.
        assert list(sent.token_ids) == prompt
        assert [e.HasField("value") for e in sent.token_logprobs] == [False, True, True]
        assert [e.value for e in sent.token_logprobs[1:]] == [-1.5, -3.0]
        assert [list(t.token_ids) for t in sent.top_logprobs] == [[], [9], [9]]
        assert [list(t.values) for t in sent.top_logprobs] == [[], [-0.25], [-0.5]]
    assert (
        not GenerateResponses(prompt, stream=False)
        .on_output(output([10], FinishReason.LENGTH))[0]
        .complete.HasField("input_logprobs")
    )


def test_an_engine_error_is_not_a_completion() -> None:
    responses = GenerateResponses([5], stream=True)
    with pytest.raises(EngineRequestError, match="grammar"):
        responses.on_output(output([], FinishReason.ERROR, error="bad grammar"))


def test_loads_per_rank_and_filtered() -> None:
    loads = [RankLoad(2, 1, 0.25, 75), RankLoad(0, 0, 0.0, 100)]
    response = convert.to_loads_response(vpb.GetLoadsRequest(), loads, [INFO, INFO])
    assert response.dp_rank_count == 2
    first = response.loads[0]
    assert (first.num_running_reqs, first.num_waiting_reqs, first.num_total_reqs) == (2, 1, 3)
    assert first.num_used_tokens == 25 * 16 and first.max_total_num_tokens == 100 * 16
    assert first.token_usage == 0.25 and first.max_running_requests == 8
    only = convert.to_loads_response(vpb.GetLoadsRequest(dp_rank=1), loads, [INFO, INFO])
    assert [load.dp_rank for load in only.loads] == [1]
    with pytest.raises(InvalidRequestError, match="dp_rank"):
        convert.to_loads_response(vpb.GetLoadsRequest(dp_rank=2), loads, [INFO, INFO])


def test_model_info_points_at_the_local_model_dir(tiny_model_dir: Path) -> None:
    model = convert.ModelMetadata.read(tiny_model_dir)
    info = convert.to_model_info(tiny_model_dir, "tiny", [INFO], model)
    assert info.tokenizer_path == str(tiny_model_dir) == info.model_path
    assert info.served_model_name == "tiny" and info.is_generation
    assert list(info.architectures) == ["LlamaForCausalLM"] and info.model_type == "llama"
    assert list(info.eos_token_ids) == [2] and info.bos_token_id == 1
    assert info.max_context_length == 1024 and info.max_req_input_len == 1023


def test_tokenizer_archive_in_chunks(tiny_model_dir: Path) -> None:
    archive = build_archive(tiny_model_dir)
    chunks = list(archive_chunks(archive, chunk_bytes=1 << 16))
    assert b"".join(data for data, _ in chunks) == archive
    assert [digest for _, digest in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1][1] == hashlib.sha256(archive).hexdigest()
    names = zipfile.ZipFile(io.BytesIO(archive)).namelist()
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(names)
    assert "model.safetensors" not in names
