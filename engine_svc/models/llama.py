"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-like, Qwen2) over a flattened batch.

Weights keep their Hugging Face names so a checkpoint loads as is. After loading, q/k/v
and gate/up are fused into one matmul each, and every projection's weight is stored
transposed, [in, out]: on CPU, MKL's GEMM then skips transposing the weight while packing
it at every call (decode's skinny matmuls ran 1.4x faster), with bit-identical results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.layers.attention import AttentionMetadata, paged_attention
from engine_svc.layers.rotary import RotaryEmbedding, apply_rotary
from engine_svc.models.model_spec import ModelSpec

KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 then cast back, exactly as Hugging Face does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """An [out, in] weight as a contiguous [in, out] tensor, for `matmul`."""
    return weight.detach().t().contiguous()


def matmul(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight_t (+ bias), weight_t being [in, out]: F.linear with a transposed weight."""
    if bias is None:
        return x @ weight_t
    return torch.addmm(bias, x, weight_t)


class Projection(nn.Module):
    """A linear layer without nn.Linear's init cost. `weight` keeps the HF name and layout
    for loading; `transpose()` then swaps it for the buffer `weight_t`, [in, out]."""

    weight_t: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("weight_t", None, persistent=False)

    def transpose(self) -> None:
        self.weight_t = transposed(self.weight)
        del self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t is None:
            return F.linear(x, self.weight, self.bias)
        return matmul(x, self.weight_t, self.bias)


class Attention(nn.Module):
    qkv_weight_t: torch.Tensor | None  # buffers, set by fuse()
    qkv_bias: torch.Tensor | None

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        q_size = spec.num_heads * spec.head_dim
        kv_size = spec.num_kv_heads * spec.head_dim
        self.q_proj = Projection(spec.hidden_size, q_size, spec.attention_bias)
        self.k_proj = Projection(spec.hidden_size, kv_size, spec.attention_bias)
        self.v_proj = Projection(spec.hidden_size, kv_size, spec.attention_bias)
        self.o_proj = Projection(q_size, spec.hidden_size, False)
        self.split_sizes = (q_size, kv_size, kv_size)
        self.register_buffer("qkv_weight_t", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)

    def fuse(self) -> None:
        weights: list[torch.Tensor] = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        self.qkv_weight_t = transposed(torch.cat(weights))
        if self.q_proj.bias is not None:
            biases = [self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]
            self.qkv_bias = torch.cat([b for b in biases if b is not None]).detach()
        del self.q_proj, self.k_proj, self.v_proj
        self.o_proj.transpose()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert self.qkv_weight_t is not None, "call fuse() after loading weights"
        qkv = matmul(x, self.qkv_weight_t, self.qkv_bias)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = apply_rotary(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    gate_up_weight_t: torch.Tensor | None  # a buffer, set by fuse()

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = Projection(spec.hidden_size, spec.intermediate_size, False)
        self.up_proj = Projection(spec.hidden_size, spec.intermediate_size, False)
        self.down_proj = Projection(spec.intermediate_size, spec.hidden_size, False)
        self.register_buffer("gate_up_weight_t", None, persistent=False)

    def fuse(self) -> None:
        self.gate_up_weight_t = transposed(torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        del self.gate_proj, self.up_proj
        self.down_proj.transpose()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.gate_up_weight_t is not None, "call fuse() after loading weights"
        gate, up = matmul(x, self.gate_up_weight_t, None).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = LlamaModel(spec)
        self.rotary = RotaryEmbedding(
            spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling
        )
        self.lm_head = Projection(spec.hidden_size, spec.vocab_size, False)

    def finish_loading(self) -> None:
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # type: ignore[assignment]
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
