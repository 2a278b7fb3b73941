"""Prompt logprobs (vLLM's `prompt_logprobs`) against Hugging Face's log-softmax over the
prompt, under every scheduling regime that cuts a prompt differently: whole, in chunks (one
of a single token), with its prefix in the cache, recomputed after a preemption, pipelined."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine_svc import LLM, SamplingParams
from engine_svc.messages import TokenLogprobs
from engine_svc.worker import model_runner
from engine_svc.worker.input_batch import ModelInputs, PromptLogprobRows, prepare_inputs
from engine_svc.worker.prompt_logprobs import BLOCK_ROWS
from shared.errors import InvalidRequestError
from tests.engine_svc.engine_helpers import assert_kv_cache_clean
from tests.engine_svc.hf_reference import load_hf_model

TOLERANCE = 1e-4  # float32, the tiny model: the logits agree to about 1e-5

# name -> engine options; each must show what its name says (checked in the test)
SCENARIOS: dict[str, dict[str, Any]] = {
    "whole": {},
    "chunked_prefill": {"max_num_batched_tokens": 32},
    "prefix_caching": {"enable_prefix_caching": True},
    # Chunks too: a prompt preempted between its chunks is recomputed from its start.
    "preemption": {"num_kv_blocks": 30, "max_model_len": 400, "max_num_batched_tokens": 32},
    "batch_queue": {"max_concurrent_batches": 2, "max_num_batched_tokens": 64},
    # Preempted while chunks of its prompt are still in flight in the other batches.
    "batch_queue_preemption": {
        "max_concurrent_batches": 3,
        "max_num_batched_tokens": 32,
        "num_kv_blocks": 30,
        "max_model_len": 400,
    },
    "torch_paths": {"cpu_kernels": False},  # log_softmax and top-k in torch, not logprobs.cpp
}


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(77)
    lengths = [1, 2, BLOCK_ROWS + 44, *rng.integers(3, 200, size=9).tolist()]
    prompts = [rng.integers(3, 49152, size=int(n)).tolist() for n in lengths]
    params = []
    for i in range(len(prompts)):
        # Every third request asks for none: its neighbours' must not leak into it.
        num_top = None if i % 3 == 2 else (0, 1, 5)[i % 3]
        params.append(
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=num_top)
        )
    return prompts, params


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[torch.Tensor]:
    """HF's log-softmax at every prompt position: row i predicts prompt token i + 1."""
    hf = load_hf_model(tiny_model_dir)
    prompts, _ = _workload()
    with torch.inference_mode():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1) for p in prompts]


def assert_matches(
    got: list[TokenLogprobs] | None, prompt: list[int], expected: torch.Tensor, num_top: int
) -> None:
    assert got is not None and len(got) == len(prompt) - 1
    for position, entry in enumerate(got):
        row = expected[position]
        token = prompt[position + 1]
        assert entry.token_id == token
        assert abs(entry.logprob - row[token].item()) < TOLERANCE, position
        # Its rank among HF's values, up to ties within the tolerance.
        above = int((row > row[token] + TOLERANCE).sum()) + 1
        tied = int((row > row[token] - TOLERANCE).sum()) + 1
        assert above <= entry.rank <= tied
        assert len(entry.top_token_ids) == len(entry.top_logprobs) == num_top
        top_values = row.topk(num_top).values.tolist() if num_top else []
        assert np.allclose(entry.top_logprobs, top_values, atol=TOLERANCE)
        assert np.allclose(row[entry.top_token_ids].tolist(), entry.top_logprobs, atol=TOLERANCE)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_prompt_logprobs_match_hf(
    tiny_model_dir: Path, reference: list[torch.Tensor], scenario: str
) -> None:
    prompts, params = _workload()
    llm = LLM(str(tiny_model_dir), **SCENARIOS[scenario])
    if scenario == "prefix_caching":
        # The same prompts once without prompt logprobs: every full block is in the cache.
        plain = [SamplingParams(temperature=0.0, max_tokens=1) for _ in prompts]
        llm.generate(prompts, plain)
    outputs = llm.generate(prompts, params)
    for prompt, param, out, expected in zip(prompts, params, outputs, reference, strict=True):
        if param.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert_matches(out.prompt_logprobs, prompt, expected, param.prompt_logprobs)
            # Computed whole: the cache served none of its prompt.
            assert out.num_cached_tokens == 0
        assert len(out.token_ids) == 24
    stats = llm.engine_core.scheduler.make_stats()
    if scenario == "prefix_caching":
        # The requests without prompt logprobs still hit the cache.
        hit = [
            o.num_cached_tokens
            for p, o in zip(params, outputs, strict=True)
            if p.prompt_logprobs is None
        ]
        assert any(hit)
        # And what the others computed is in it for later requests.
        again = llm.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=1))
        assert again[0].num_cached_tokens > 0
    if scenario.endswith("preemption"):
        assert stats.num_preemptions > 0
    assert_kv_cache_clean(llm)


def test_a_one_token_chunk_gives_its_prompt_logprob(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a budget of 32 tokens, the first step takes the 31-token prompt and one token of
    the next: that token runs as a single-token row, and its logits still give a logprob."""
    spans: list[PromptLogprobRows] = []

    def recording(*args: Any, **kwargs: Any) -> ModelInputs:
        inputs = prepare_inputs(*args, **kwargs)
        spans.extend(inputs.prompt_logprob_rows)
        return inputs

    monkeypatch.setattr(model_runner, "prepare_inputs", recording)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 49152, size=n).tolist() for n in (31, 40)]
    llm = LLM(str(tiny_model_dir), max_num_batched_tokens=32)
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    )
    assert any(span.first == 1 and span.count == 1 for span in spans)
    hf = load_hf_model(tiny_model_dir)
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs, strict=True):
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
            assert_matches(out.prompt_logprobs, prompt, expected, 2)
    assert_kv_cache_clean(llm)


@pytest.mark.parametrize("value", [-1, 21])
def test_prompt_logprobs_out_of_range_are_refused_by_name(value: int) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(prompt_logprobs=value).validate()
    assert caught.value.field == "prompt_logprobs"
