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
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine_svc.kernels import paged_decode_attention


@dataclasses.dataclass(slots=True)
class PrefillChunk:
    query_start: int  # offset in the flattened batch
    query_len: int
    context_slots: torch.Tensor | None  # cache slots of all context tokens; None if none cached
    mask: torch.Tensor | None  # [query_len, context_len] additive (0 / -inf), with context_slots


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
    is_causal: bool = True
    decode_kernel: DecodeKernelInputs | None = None  # set: decodes run the C++ kernel
    # Set: the chunks without context run the C++ kernel (and have no PrefillChunk entry).
    prefill_kernel: PrefillKernelInputs | None = None
    # Gathered K and V of the decodes, reused by every layer of the step: a fresh multi-MB
    # tensor per layer comes from mmap and pays a page fault for each 4 KiB it touches.
    decode_kv_buffers: tuple[torch.Tensor, torch.Tensor] | None = None


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    # One cache row per token slot: index_copy_ and index_select on 2-D views copy whole
    # rows, several times faster than on the 3-D or 4-D shapes.
    k_rows = k_cache.view(-1, k[0].numel())
    v_rows = v_cache.view(-1, v[0].numel())
    k_rows.index_copy_(0, meta.slot_mapping, k.reshape(len(k), -1))
    v_rows.index_copy_(0, meta.slot_mapping, v.reshape(len(v), -1))

    if not meta.prefills and meta.prefill_kernel is None:  # a pure decode step
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if meta.prefill_kernel is not None:
        starts, lens = meta.prefill_kernel.query_starts, meta.prefill_kernel.query_lens
        torch.ops.duoserve.prefill_attention_(out, q, k, v, starts, lens, scale)
    if meta.num_decodes:
        decode = slice(0, meta.num_decodes)
        out[decode] = _decode_attention(q[decode], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        if chunk.context_slots is None:
            out[rows] = _attend(q[rows], k[rows], v[rows], None, meta.is_causal, scale)
        else:
            context_k = k_rows.index_select(0, chunk.context_slots).view(-1, *k.shape[1:])
            context_v = v_rows.index_select(0, chunk.context_slots).view(-1, *v.shape[1:])
            out[rows] = _attend(q[rows], context_k, context_v, chunk.mask, False, scale)
    return out


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    assert meta.decode_block_tables is not None
    if meta.decode_kernel is not None:
        return paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_kernel.context_lens,
            meta.decode_kernel.max_context_len,
            scale,
        )
    assert meta.decode_mask is not None
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
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=meta.decode_mask, scale=scale
    )
    return out.reshape(num_seqs, num_heads, head_dim)


def _attend(
    q: torch.Tensor,  # [q_len, heads, d]
    k: torch.Tensor,  # [kv_len, kv_heads, d]
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
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
