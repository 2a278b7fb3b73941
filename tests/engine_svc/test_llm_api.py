"""The offline API as users call it, aborts, start-up sizing and the non-causal guard."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from engine_svc import LLM, SamplingParams
from engine_svc.core.kv_cache.sizing import KVCacheTooSmallError
from engine_svc.messages import EngineCoreRequest, FinishReason
from shared.errors import InvalidRequestError
from tests.engine_svc.engine_helpers import assert_kv_cache_clean


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=256)


def test_generate_accepts_text_and_token_ids_and_keeps_order(llm: LLM) -> None:
    text_prompt = "Hello, world"
    ids_prompt = llm.tokenizer.encode("Another prompt entirely")
    params = [
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0, max_tokens=5),
    ]
    outputs = llm.generate([text_prompt, ids_prompt], params)
    assert [len(o.token_ids) for o in outputs] == [3, 5]
    assert outputs[0].prompt == text_prompt
    assert outputs[0].prompt_token_ids == llm.tokenizer.encode(text_prompt)
    assert outputs[1].prompt is None and outputs[1].prompt_token_ids == ids_prompt
    assert all(o.finish_reason == "length" for o in outputs)
    assert outputs[0].text == llm.tokenizer.decode(outputs[0].token_ids, skip_special_tokens=True)
    # One prompt as a single string or a single list of token ids works too.
    assert len(llm.generate(text_prompt, params[0])) == 1
    assert len(llm.generate(ids_prompt, params[0])) == 1
    assert_kv_cache_clean(llm)


def test_invalid_requests_name_the_field(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        llm.generate([[1, 2]], SamplingParams(temperature=-1))  # checked where it enters
    assert excinfo.value.field == "temperature"
    cases = {
        "prompt_token_ids": ([], SamplingParams()),
        "max_tokens": ([1, 2, 3], SamplingParams(max_tokens=300)),
    }
    for field, (prompt, params) in cases.items():
        with pytest.raises(InvalidRequestError) as excinfo:
            llm.generate([prompt], params)
        assert excinfo.value.field == field
    with pytest.raises(InvalidRequestError) as excinfo:
        llm.generate([[10**9]], SamplingParams())
    assert excinfo.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as excinfo:
        llm.generate(["a", "b"], [SamplingParams()])
    assert excinfo.value.field == "sampling_params"
    assert_kv_cache_clean(llm)


def test_abort_mid_generation_frees_every_block(llm: LLM) -> None:
    client = llm.client
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    for i in range(8):
        prompt = llm.tokenizer.encode(f"request number {i} " * (i + 1))
        client.add_request(
            EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params)
        )
    for _ in range(5):
        client.get_output()
    assert llm.engine_core.scheduler.kv_cache.usage > 0
    client.abort_requests([f"r{i}" for i in range(0, 8, 2)] + ["unknown-id"])
    finished: dict[str, FinishReason] = {}
    for _ in range(200):
        for output in client.get_output().outputs:
            if output.finish_reason is not None:
                finished[output.request_id] = output.finish_reason
        if len(finished) == 8:
            break
    assert {finished[f"r{i}"] for i in range(0, 8, 2)} == {FinishReason.ABORT}
    assert {finished[f"r{i}"] for i in range(1, 8, 2)} == {FinishReason.LENGTH}
    client.abort_requests(["r1"])  # idempotent: already finished
    client.get_output()
    assert_kv_cache_clean(llm)


def test_start_up_sizes_the_kv_cache_and_logs_it(tiny_model_dir: Path, caplog) -> None:
    with caplog.at_level(logging.INFO):
        llm = LLM(str(tiny_model_dir), max_model_len=512, kv_cache_memory_bytes=512 << 20)
    plan = llm.engine_core.kv_plan
    assert plan.num_blocks >= 512 // 16
    assert any("max concurrency" in r.getMessage() for r in caplog.records)


def test_refuses_to_start_when_one_request_cannot_fit(tiny_model_dir: Path) -> None:
    with pytest.raises(KVCacheTooSmallError, match="max_model_len=1024"):
        LLM(str(tiny_model_dir), kv_cache_memory_bytes=16 << 20)
    with pytest.raises(KVCacheTooSmallError, match="num_kv_blocks"):
        LLM(str(tiny_model_dir), num_kv_blocks=8)


def test_non_causal_model_turns_off_chunking_and_prefix_caching(
    tiny_model_dir: Path, tmp_path: Path, caplog
) -> None:
    model_dir = tmp_path / "prefix-lm"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["use_bidirectional_attention"] = True
    (model_dir / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(model_dir), max_model_len=256)
    scheduler_config = llm.engine_core.scheduler.config
    assert not scheduler_config.enable_chunked_prefill
    assert not scheduler_config.enable_prefix_caching
    assert any(
        "chunked prefill and prefix caching are off" in r.getMessage() for r in caplog.records
    )
    outputs = llm.generate(["a prompt that attends both ways"], SamplingParams(max_tokens=4))
    assert len(outputs[0].token_ids) == 4
