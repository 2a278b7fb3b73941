"""The engine on a CUDA device (skipped without one): bfloat16 greedy tokens against Hugging
Face bfloat16 on the same GPU, the KV cache sized from the device's memory, and the gather +
SDPA attention that serves CUDA under chunked prefill and prefix caching. Float32 exactness on
CUDA is test_greedy_matches_hf.py's, parametrized by device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine_svc import LLM, SamplingParams
from tests.engine_svc.engine_helpers import assert_kv_cache_clean

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

# As test_bfloat16.py: bfloat16 logits carry 8 significant bits, so a step's token must be
# Hugging Face's argmax or within two roundings of it.
NEAR_TIE = 0.25


def _prompts(count: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(91)
    lengths = rng.integers(1, 300, size=count)
    prompts = [rng.integers(3, 49152, size=int(n)).tolist() for n in lengths]
    return prompts, rng.integers(8, 40, size=count).tolist()


@torch.inference_mode()
def _hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output], device="cuda")
    logits = model(ids).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(output) - 1], dim=-1)


def test_bfloat16_greedy_tokens_are_hf_bfloat16_argmax_on_the_same_gpu(
    tiny_model_dir: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    prompts, max_tokens = _prompts(16)
    # Small steps: prompts split over chunks, decodes batched beside them.
    llm = LLM(str(tiny_model_dir), dtype="bfloat16", device="cuda", num_kv_blocks=512,
              max_num_batched_tokens=96)  # fmt: skip
    assert llm.engine_core.executor.runner.device.type == "cuda"
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens]
    outputs = [out.token_ids for out in llm.generate(prompts, params)]
    assert_kv_cache_clean(llm)

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    hf = hf.to("cuda").eval()  # type: ignore[arg-type]
    argmax_steps = 0
    for prompt, tokens, limit in zip(prompts, outputs, max_tokens, strict=True):
        assert len(tokens) == limit
        logprobs = _hf_logprobs(hf, prompt, tokens)
        chosen = torch.tensor(tokens, device="cuda")
        best = logprobs.max(dim=-1)
        gaps = best.values - logprobs[torch.arange(len(tokens)), chosen]
        assert gaps.max().item() <= NEAR_TIE, (prompt[:5], gaps.max().item())
        argmax_steps += int((best.indices == chosen).sum())
    assert argmax_steps >= 0.95 * sum(max_tokens), (argmax_steps, sum(max_tokens))


def test_kv_cache_takes_its_share_of_the_device_memory(tiny_model_dir: Path) -> None:
    share = 0.02
    # Enough sequences that the share, not max_num_seqs x max_model_len, bounds the cache.
    llm = LLM(str(tiny_model_dir), device="cuda", gpu_memory_utilization=share,
              max_num_seqs=8192)  # fmt: skip
    runner = llm.engine_core.executor.runner
    total = torch.cuda.get_device_properties(runner.device).total_memory
    num_blocks = llm.engine_core.info().num_kv_blocks
    kv_bytes = num_blocks * runner.kv_bytes_per_block()
    # The cache is what the share leaves after the weights and a step's activations.
    assert runner.weight_bytes + kv_bytes <= share * total
    assert kv_bytes >= 0.5 * share * total
    cache = runner.kv_caches[0][0]
    assert cache.is_cuda and cache.shape[0] == num_blocks
    outputs = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(outputs[0].token_ids) == 4
    assert_kv_cache_clean(llm)


def test_kv_cache_holds_no_more_than_its_requests_can_use(tiny_model_dir: Path) -> None:
    """90% of a large GPU would be dead memory for a small model: the cache stops at
    max_num_seqs requests of max_model_len."""
    llm = LLM(str(tiny_model_dir), device="cuda", max_num_seqs=8, max_model_len=256)
    assert llm.engine_core.info().num_kv_blocks == 8 * 256 // 16
