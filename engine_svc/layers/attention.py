"""Attention over a paged KV cache, in plain torch so it runs on CPU and CUDA alike.

The batch is flattened: decode tokens (one query each) first, then prefill chunks. Each
layer writes the new K/V into their cache slots, then:
- decodes read their context straight from the cache with the C++ CPU kernel
  (engine_svc/kernels) where it is built, or else run as one batched SDPA over their
  gathered blocks, masked to each context;
- a prefill chunk with no cached context attends to its own K/V (causal, or both ways
  for prefix-LM models): all such chunks of a step in one call of the C++ kernel where it
  serves the model, else one SDPA each; a chunk after cached tokens gathers its context
  from the cache.

A layer with a sliding window (`window`: tokens back, itself included) attends only to
positions after p - window from position p: the C++ kernels skip the rest, the torch path
masks it out (masks built on first use in a step, then shared by the layers).

Gemma 2 squashes the attention scores (cap * tanh(scores / cap)): SDPA cannot, so those
layers take the explicit product, softmax and sum, in transformers' order (the C++
kernels are off for such models).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine_svc.kernels import paged_decode_attention, torch_bf16_matmul_is_scalar

SOFTCAP_QUERY_BLOCK = 256  # queries per block of soft-capped attention


@dataclasses.dataclass(slots=True)
class PrefillChunk:
    query_start: int  # offset in the flattened batch
    query_len: int
    context_slots: torch.Tensor | None  # cache slots of all context tokens; None if none cached
    mask: torch.Tensor | None  # [query_len, context_len] additive (0 / -inf), with context_slots
    # Masks of the windowed layers, by window, built on first use.
    window_masks: dict[int, torch.Tensor | None] = dataclasses.field(default_factory=dict)

    def mask_for(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """The chunk's mask within `window`: None where the window hides nothing (causal
        over the chunk's own tokens, or its full-attention `mask`)."""
        if window is None:
            return self.mask
        if window not in self.window_masks:
            self.window_masks[window] = self._windowed(window, device)
        return self.window_masks[window]

    def _windowed(self, window: int, device: torch.device) -> torch.Tensor | None:
        num_keys = self.query_len if self.mask is None else self.mask.shape[1]
        if num_keys <= window:
            return self.mask  # no query reaches back past its window
        queries = torch.arange(num_keys - self.query_len, num_keys, device=device).unsqueeze(1)
        keys = torch.arange(num_keys, device=device).unsqueeze(0)
        outside = keys <= queries - window
        if self.mask is None:  # a boolean mask, True where a query attends
            return (keys <= queries) & ~outside
        return self.mask.masked_fill(outside, float("-inf"))


@dataclasses.dataclass(slots=True)
class DecodeKernelInputs:
    """What the C++ decode kernel reads besides the block tables (int32 there)."""

    context_lens: torch.Tensor  # int32 [num_decodes]
    max_context_len: int


@dataclasses.dataclass(slots=True)
class PrefillKernelInputs:
    """The causal prefill chunks with no cached context, for the C++ kernel (int32)."""

    query_starts: torch.Tensor
    query_lens: torch.Tensor


@dataclasses.dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    # [num_decodes, 1, 1, max_blocks * block_size], additive (0 / -inf) in the model dtype:
    # built once per step rather than converted from bool by every layer. None with a kernel.
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    # Each decode's context length (long), for the windowed decode masks; with decode_mask.
    decode_context_lens: torch.Tensor | None = None
    is_causal: bool = True
    decode_kernel: DecodeKernelInputs | None = None  # set: decodes run the C++ kernel
    # Set: the chunks without context run the C++ kernel (and have no PrefillChunk entry).
    prefill_kernel: PrefillKernelInputs | None = None
    # Gathered K and V of the decodes, reused by every layer of the step: a fresh multi-MB
    # tensor per layer comes from mmap and pays a page fault for each 4 KiB it touches.
    decode_kv_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    decode_window_masks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def decode_mask_for(self, window: int | None) -> torch.Tensor | None:
        """decode_mask, also hiding each decode's keys before its window."""
        if window is None or self.decode_mask is None:
            return self.decode_mask
        if window not in self.decode_window_masks:
            assert self.decode_context_lens is not None
            keys = torch.arange(self.decode_mask.shape[-1], device=self.decode_mask.device)
            first = (self.decode_context_lens - window).view(-1, 1, 1, 1)
            self.decode_window_masks[window] = self.decode_mask.masked_fill(
                keys < first, float("-inf")
            )
        return self.decode_window_masks[window]


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    # One cache row per token slot: index_copy_ and index_select on 2-D views copy whole
    # rows, several times faster than on the 3-D or 4-D shapes.
    k_rows = k_cache.view(-1, k[0].numel())
    v_rows = v_cache.view(-1, v[0].numel())
    k_rows.index_copy_(0, meta.slot_mapping, k.reshape(len(k), -1))
    v_rows.index_copy_(0, meta.slot_mapping, v.reshape(len(v), -1))

    if not meta.prefills and meta.prefill_kernel is None:  # a pure decode step
        return _decode_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    out = torch.empty_like(q)
    if meta.prefill_kernel is not None:
        starts, lens = meta.prefill_kernel.query_starts, meta.prefill_kernel.query_lens
        torch.ops.duoserve.prefill_attention_(out, q, k, v, starts, lens, scale, window or 0)
    if meta.num_decodes:
        decode = slice(0, meta.num_decodes)
        out[decode] = _decode_attention(q[decode], k_cache, v_cache, meta, scale, window, softcap)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        mask = chunk.mask_for(window, q.device) if meta.is_causal else None
        if chunk.context_slots is None:
            out[rows] = _attend(q[rows], k[rows], v[rows], mask, meta.is_causal, scale, softcap)
        else:
            context_k = k_rows.index_select(0, chunk.context_slots).view(-1, *k.shape[1:])
            context_v = v_rows.index_select(0, chunk.context_slots).view(-1, *v.shape[1:])
            mask = chunk.mask_for(window, q.device)
            out[rows] = _attend(q[rows], context_k, context_v, mask, False, scale, softcap)
    return out


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    assert meta.decode_block_tables is not None
    if meta.decode_kernel is not None:
        assert softcap is None, "the decode kernel does not soft-cap"
        return paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_kernel.context_lens,
            meta.decode_kernel.max_context_len,
            scale,
            window,
        )
    mask = meta.decode_mask_for(window)
    assert mask is not None
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    # Gather each sequence's blocks, viewed as [seqs, kv_heads, context, d].
    # On 2-D views: index_select copies whole rows then, 4x faster than on the 4-D cache.
    table = meta.decode_block_tables.flatten()
    context = meta.decode_block_tables.shape[1] * k_cache.shape[1]
    shape = (num_seqs, context, num_kv_heads, head_dim)
    if meta.decode_kv_buffers is None:
        rows = (len(table), k_cache[0].numel())
        meta.decode_kv_buffers = (k_cache.new_empty(rows), v_cache.new_empty(rows))
    key_rows, value_rows = meta.decode_kv_buffers
    keys = torch.index_select(k_cache.flatten(1), 0, table, out=key_rows).view(shape)
    values = torch.index_select(v_cache.flatten(1), 0, table, out=value_rows).view(shape)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    # The query heads of one KV head act as a group of queries: no K/V repetition needed.
    queries = q.view(num_seqs, num_kv_heads, group, head_dim)
    dtype = q.dtype
    if _attends_in_float32(q):
        queries, keys, values, mask = queries.float(), keys.float(), values.float(), mask.float()
    if softcap is not None:
        out = _softcapped_attention(queries, keys, values, mask, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim).to(dtype)


def _attend(
    q: torch.Tensor,  # [q_len, heads, d]
    k: torch.Tensor,  # [kv_len, kv_heads, d]
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    if _attends_in_float32(q):
        if mask is not None and mask.is_floating_point():
            mask = mask.float()
        out = _attend(q.float(), k.float(), v.float(), mask, is_causal, scale, softcap)
        return out.to(q.dtype)
    if softcap is not None:
        queries = q.transpose(0, 1).unsqueeze(0)
        group = q.shape[1] // k.shape[1]
        keys = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        values = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        if mask is None and is_causal:
            mask = torch.ones(len(q), len(k), dtype=torch.bool, device=q.device).tril_()
        out = _softcapped_attention(queries, keys, values, mask, scale, softcap)
        return out[0].transpose(0, 1)
    # 4-D [1, heads, len, d]: on CPU only 4-D inputs take the flash kernel (GQA included),
    # as Hugging Face's SDPA attention does; 3-D ones fall back to the math path, 2.5x slower.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=is_causal and mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def _attends_in_float32(q: torch.Tensor) -> bool:
    """bfloat16 attention on a CPU where torch multiplies bfloat16 in scalar code runs in
    float32: torch's bfloat16 SDPA there is 3x slower than its float32 one (a 128-token
    prompt, AVX2)."""
    return q.dtype == torch.bfloat16 and q.device.type == "cpu" and torch_bf16_matmul_is_scalar()


def _softcapped_attention(
    q: torch.Tensor,  # [..., q_len, d], heads grouped as keys' heads broadcast
    k: torch.Tensor,  # [..., kv_len, d]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # boolean (True: attend) or additive
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Attention with the scores squashed to (-softcap, softcap), as Gemma 2 computes it,
    SOFTCAP_QUERY_BLOCK queries at a time: the scores of a long chunk would otherwise be
    [heads, queries, keys] at once, far above the activation peak the KV cache was sized
    around."""
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    keys_t = k.transpose(-1, -2)
    for start in range(0, q.shape[-2], SOFTCAP_QUERY_BLOCK):
        rows = slice(start, start + SOFTCAP_QUERY_BLOCK)
        scores = torch.matmul(q[..., rows, :], keys_t) * scale
        scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            block_mask = mask[..., rows, :] if mask.shape[-2] > 1 else mask
            if block_mask.dtype == torch.bool:
                scores = scores.masked_fill(~block_mask, float("-inf"))
            else:
                scores = scores + block_mask
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[..., rows, :] = torch.matmul(weights, v)
    return out
