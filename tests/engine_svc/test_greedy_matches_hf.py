"""Greedy outputs equal Hugging Face `generate`, token for token, under every scheduling
regime: all at once, staggered arrivals, forced chunked prefill, shared prefixes with
prefix caching, forced preemption, and pipelined batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine_svc import LLM, SamplingParams
from tests.engine_svc.engine_helpers import assert_kv_cache_clean, generate_staggered
from tests.engine_svc.hf_reference import hf_greedy, load_hf_model

# name -> (engine options, staggered arrivals?, what the regime must show)
SCENARIOS: dict[str, tuple[dict[str, Any], bool, str | None]] = {
    "all_at_once": ({}, False, None),
    "staggered": ({}, True, None),
    "chunked_prefill": ({"max_num_batched_tokens": 32}, False, None),
    "prefix_caching": ({"enable_prefix_caching": True}, True, "hits"),
    "preemption": ({"num_kv_blocks": 30, "max_model_len": 400}, False, "preemptions"),
    "batch_queue": ({"max_concurrent_batches": 2, "max_num_batched_tokens": 64}, False, None),
    # Preempted with outputs of the request still in flight in the other batches.
    "batch_queue_preemption": (
        {
            "max_concurrent_batches": 3,
            "max_num_batched_tokens": 64,
            "num_kv_blocks": 30,
            "max_model_len": 400,
        },
        False,
        "preemptions",
    ),
    # The plain-torch attention, as on CUDA or where the C++ kernels cannot build.
    "torch_attention": ({"cpu_kernels": False}, True, None),
    "no_caching_no_chunking": (
        {"enable_prefix_caching": False, "enable_chunked_prefill": False},
        True,
        None,
    ),
}


def _tiny_workload() -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(1234)
    shared_prefix = rng.integers(3, 49152, size=80).tolist()
    prompts = []
    for i, length in enumerate(rng.integers(1, 301, size=32)):
        tail = rng.integers(3, 49152, size=int(length)).tolist()
        # Half the prompts share a prefix, so prefix caching has something to find.
        prompts.append(shared_prefix + tail[:200] if i % 2 else tail)
    max_tokens = rng.integers(1, 48, size=32).tolist()
    return prompts, max_tokens


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir: Path) -> tuple[list[list[int]], list[int], list[list[int]]]:
    prompts, max_tokens = _tiny_workload()
    return prompts, max_tokens, hf_greedy(load_hf_model(tiny_model_dir), prompts, max_tokens)


def _run(
    llm: LLM, prompts: list[list[int]], max_tokens: list[int], staggered: bool
) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens]
    if staggered:
        arrivals = [3 * (i % 11) for i in range(len(prompts))]
        return generate_staggered(llm, prompts, params, arrivals)
    return [out.token_ids for out in llm.generate(prompts, params)]


def _check_regime(llm: LLM, expect: str | None) -> None:
    stats = llm.engine_core.scheduler.make_stats()
    if expect == "hits":
        assert stats.prefix_cache_hits > 0
    if expect == "preemptions":
        assert stats.num_preemptions > 0


# Our engine on CUDA against the same float32 reference (computed on CPU): cuBLAS and SDPA's
# CUDA kernels round differently from CPU's, the tiny model's peaky logits absorb that.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_tiny_model_greedy_matches_hf(
    tiny_model_dir: Path, tiny_reference, scenario: str, device: str
) -> None:
    prompts, max_tokens, expected = tiny_reference
    options, staggered, expect = SCENARIOS[scenario]
    if device != "cpu":  # a fixed cache, not 90% of the accelerator for each engine
        options = {"num_kv_blocks": 1024, **options, "device": device}
    llm = LLM(str(tiny_model_dir), **options)
    got = _run(llm, prompts, max_tokens, staggered)
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
    assert not mismatches, f"prompts {mismatches} differ from HF"
    _check_regime(llm, expect)
    assert_kv_cache_clean(llm)


DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "Explain why the sky is blue in one paragraph.",
    "List three prime numbers:",
    "In 1969, humans first",
    "The quick brown fox",
    "Translate to French: good morning, my friend.",
]


@pytest.fixture(scope="module")
def default_reference(default_model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    system = [{"role": "system", "content": "You are a concise, helpful assistant."}]
    prompts = []
    for i, text in enumerate(DEFAULT_PROMPTS):
        if i % 2:  # chat-templated prompts share the system-prompt prefix
            messages = [*system, {"role": "user", "content": text}]
            rendered = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            prompts.append(tokenizer.encode(rendered, add_special_tokens=False))
        else:
            prompts.append(tokenizer.encode(text))
    expected = hf_greedy(load_hf_model(default_model_dir), prompts, [32] * len(prompts))
    return prompts, expected


DEFAULT_SCENARIOS = {
    **SCENARIOS,
    "chunked_prefill": ({"max_num_batched_tokens": 24}, False, None),
    "preemption": ({"num_kv_blocks": 12, "max_model_len": 128}, False, "preemptions"),
    "batch_queue_preemption": (
        {
            "max_concurrent_batches": 3,
            "max_num_batched_tokens": 64,
            "num_kv_blocks": 12,
            "max_model_len": 128,
        },
        False,
        "preemptions",
    ),
}


@pytest.mark.default_model
@pytest.mark.parametrize("scenario", DEFAULT_SCENARIOS)
def test_default_model_greedy_matches_hf(
    default_model_dir: Path, default_reference, scenario: str
) -> None:
    prompts, expected = default_reference
    options, staggered, expect = DEFAULT_SCENARIOS[scenario]
    # A short model length and a fixed cache keep each engine small and quick to start.
    options = {"max_model_len": 1024, "num_kv_blocks": 256, **options}
    llm = LLM(str(default_model_dir), **options)
    got = _run(llm, prompts, [32] * len(prompts), staggered)
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
    assert not mismatches, f"prompts {mismatches} differ from HF"
    _check_regime(llm, expect)
    assert_kv_cache_clean(llm)
