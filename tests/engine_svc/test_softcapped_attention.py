"""Gemma 2's soft-capped attention (torch path, queries in blocks) against the formula over
the whole chunk at once: a causal prefill longer than two blocks, and a windowed one."""

from __future__ import annotations

import torch

from engine_svc.layers.attention import SOFTCAP_QUERY_BLOCK, _attend


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
               scale: float, cap: float) -> torch.Tensor:  # fmt: skip
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    scores = (torch.tanh(scores / cap) * cap).masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)


def test_soft_capped_prefill_in_query_blocks_equals_the_whole_chunk() -> None:
    generator = torch.Generator().manual_seed(0)
    length = 2 * SOFTCAP_QUERY_BLOCK + 37
    q = torch.randn(length, 8, 16, generator=generator) * 3
    k = torch.randn(length, 2, 16, generator=generator) * 3
    v = torch.randn(length, 2, 16, generator=generator)
    positions = torch.arange(length)
    causal = positions.unsqueeze(0) <= positions.unsqueeze(1)
    got = _attend(q, k, v, None, True, 0.25, softcap=5.0)
    torch.testing.assert_close(got, _reference(q, k, v, causal, 0.25, 5.0))
    window = causal & (positions.unsqueeze(0) > positions.unsqueeze(1) - 100)
    got = _attend(q, k, v, window, True, 0.25, softcap=5.0)
    torch.testing.assert_close(got, _reference(q, k, v, window, 0.25, 5.0))
