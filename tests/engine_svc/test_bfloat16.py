"""bfloat16 models on CPU. Where oneDNN has no bfloat16 kernel (AVX2) torch's bfloat16
matmul is a scalar loop, so the engine keeps bfloat16 weights
and caches (half the bytes) and computes projections and prompt attention in float32
through the kernels, rounding to bfloat16 where torch would. Where oneDNN has one, torch
multiplies: over weights prepacked in oneDNN's layout where the CPU has AMX or AVX512-BF16
(a single row through the row GEMV on a second copy where it fits), elsewhere on torch's
F.linear with a single row through the row GEMV. bfloat16 greedy decoding is
full of near-ties (logits carry 8 significant bits), so the check is teacher-forced: at
every step the token we chose is Hugging Face's bfloat16 argmax, or within a bfloat16
rounding of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine_svc import LLM, SamplingParams
from engine_svc.kernels import (
    bf16_pairs_available,
    one_row_copy_available,
    onednn_linear_available,
    packed_linear_available,
    row_gemv_available,
)
from engine_svc.layers.linear import Projection
from tests.engine_svc.engine_helpers import assert_kv_cache_clean
from tests.engine_svc.hf_reference import hf_token_logprobs

# A logit of the tiny model's size (|x| up to ~16) is rounded to 2^-4 in bfloat16; two
# roundings apart, teacher-forced prefill against incremental decoding, are a near-tie.
NEAR_TIE = 0.25


def _prompts() -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(77)
    prompts = [rng.integers(3, 49152, size=int(n)).tolist() for n in rng.integers(1, 200, 12)]
    return prompts, rng.integers(8, 40, size=12).tolist()


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_bfloat16_greedy_tokens_are_hf_bfloat16_argmax_or_a_near_tie(
    tiny_model_dir: Path, cpu_kernels: bool
) -> None:
    from transformers import AutoModelForCausalLM

    prompts, max_tokens = _prompts()
    llm = LLM(str(tiny_model_dir), dtype="bfloat16", cpu_kernels=cpu_kernels)
    runner = llm.engine_core.executor.runner
    packed = [m for m in runner.model.modules() if isinstance(m, Projection)]
    kernels_serve_bf16 = cpu_kernels and packed_linear_available(torch.bfloat16)
    # Where the kernels serve bfloat16, every projection streams packed bfloat16 weights.
    assert all(
        (p.weight_packed is not None and p.weight_packed.dtype == torch.bfloat16)
        == kernels_serve_bf16
        for p in packed
    )
    # AVX512-BF16 without AMX: pairs of k for its dot products, and a model this small keeps
    # oneDNN's prepacked layout too, for prompts. Where oneDNN multiplies bfloat16
    # otherwise: its prepacked layout on AMX, else the row GEMV; on AMX a model this small
    # keeps its [out, in] weights too, for the row GEMV.
    pairs = cpu_kernels and bf16_pairs_available(torch.bfloat16)
    assert all((p.weight_pairs is not None) == pairs for p in packed)
    onednn = cpu_kernels and onednn_linear_available(torch.bfloat16)
    assert all((p.weight_onednn is not None) == onednn for p in packed)
    row_gemv = (
        cpu_kernels
        and not pairs
        and (row_gemv_available(torch.bfloat16) or one_row_copy_available(torch.bfloat16))
    )
    assert all(p.row_gemv == row_gemv for p in packed)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens]
    outputs = [out.token_ids for out in llm.generate(prompts, params)]
    assert_kv_cache_clean(llm)

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    argmax_steps = 0
    for prompt, tokens, limit in zip(prompts, outputs, max_tokens, strict=True):
        assert len(tokens) == limit
        logprobs = hf_token_logprobs(hf, prompt, tokens)
        best = logprobs.max(dim=-1)
        chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
        gaps = best.values - chosen
        assert gaps.max().item() <= NEAR_TIE, (prompt[:5], gaps.max().item())
        argmax_steps += int((best.indices == torch.tensor(tokens)).sum())
    # Near-ties are the exception, not the rule.
    assert argmax_steps >= 0.95 * sum(max_tokens), (argmax_steps, sum(max_tokens))
