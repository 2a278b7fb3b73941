"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3, Granite, OLMo 2,
Gemma 2 and 3, and the mixtures of experts Mixtral, Qwen3-MoE and OLMoE) over a flattened
batch.

Weights keep their Hugging Face names so a checkpoint loads as is. After loading, q/k/v
and gate/up are fused into one matmul each, in the layout engine_svc/layers/linear.py
chooses for the backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.distributed.collectives import SINGLE, Collectives
from engine_svc.layers.attention import AttentionMetadata, paged_attention
from engine_svc.layers.linear import Projection
from engine_svc.layers.moe import SparseMoE
from engine_svc.layers.norm import RMSNorm
from engine_svc.layers.rotary import RotaryEmbedding, apply_rotary
from engine_svc.models.model_spec import ModelSpec
from engine_svc.models.sharding import RankShards

if TYPE_CHECKING:
    from engine_svc.models.decode_layers import DecodeLayers

KVCache = tuple[torch.Tensor, torch.Tensor]

# The MLP gate activations, by their config names.
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class Attention(nn.Module):
    qkv: Projection  # q, k and v in one matmul, set by fuse()

    def __init__(
        self, spec: ModelSpec, shards: RankShards, collectives: Collectives, index: int
    ) -> None:
        super().__init__()
        self.window = spec.window_of(index)  # None: attends over the whole sequence
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = shards.num_heads
        self.num_kv_heads = shards.num_kv_heads
        self.head_dim = spec.head_dim
        self.scale = spec.attention_multiplier or spec.head_dim**-0.5
        self.collectives = collectives
        q_size = self.num_heads * spec.head_dim
        kv_size = self.num_kv_heads * spec.head_dim
        if spec.fused_checkpoint:  # Phi-3 stores them fused already, in the same order
            self.qkv_proj = Projection(spec.hidden_size, q_size + 2 * kv_size, spec.attention_bias)
        else:
            self.q_proj = Projection(spec.hidden_size, q_size, spec.attention_bias)
            self.k_proj = Projection(spec.hidden_size, kv_size, spec.attention_bias)
            self.v_proj = Projection(spec.hidden_size, kv_size, spec.attention_bias)
        self.o_proj = Projection(q_size, spec.hidden_size, False)
        self.split_sizes = (q_size, kv_size, kv_size)
        self.fused_rotary = False
        # Qwen3: each head of q and k RMS-normalised (over head_dim) before the rotary;
        # OLMo 2: all of q and all of k (over every head's dims together).
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        self.qk_norm_whole = spec.qk_norm_whole
        if spec.qk_norm:  # Gemma 3's scale by 1 + weight in float32
            offset = spec.norm_offset
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, bool(offset), offset)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, bool(offset), offset)
        elif spec.qk_norm_whole:
            self.q_norm = RMSNorm(q_size, spec.rms_norm_eps, spec.post_norms)
            self.k_norm = RMSNorm(kv_size, spec.rms_norm_eps, spec.post_norms)
        self.clip_qkv = spec.clip_qkv  # OLMoE: q, k and v clamped after the norms
        self.softcap = spec.attn_logit_softcapping  # Gemma 2

    def fuse(self) -> None:
        if hasattr(self, "qkv_proj"):
            self.qkv = self.qkv_proj
            del self.qkv_proj
            self.qkv.transpose()
        else:
            self.qkv = Projection.fused([self.q_proj, self.k_proj, self.v_proj])
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
        q, k, v = self.qkv(x).split(self.split_sizes, dim=-1)
        if self.qk_norm_whole and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q.contiguous())[0], self.k_norm(k.contiguous())[0]
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not self.qk_norm_whole and self.q_norm is not None and self.k_norm is not None:
            # One row per head. With a single K/V head (multi-query, or a tensor-parallel
            # rank's share) reshape keeps a strided view of qkv: the fused norm needs rows.
            q_rows = q.reshape(-1, self.head_dim).contiguous()
            k_rows = k.reshape(-1, self.head_dim).contiguous()
            q = self.q_norm(q_rows)[0].view(-1, self.num_heads, self.head_dim)
            k = self.k_norm(k_rows)[0].view(-1, self.num_kv_heads, self.head_dim)
        if self.fused_rotary:  # in place on qkv; cos and sin are float32 [tokens, head_dim]
            torch.ops.duoserve.rotary_inplace(q, cos, sin)
            torch.ops.duoserve.rotary_inplace(k, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window, self.softcap
        )
        return self.collectives.all_reduce(self.o_proj(out.flatten(1)))


class MLP(nn.Module):
    gate_up: Projection  # gate and up in one matmul, set by fuse()

    def __init__(self, spec: ModelSpec, shards: RankShards, collectives: Collectives) -> None:
        super().__init__()
        size = shards.mlp_rows[1] - shards.mlp_rows[0]
        self.collectives = collectives
        if spec.fused_checkpoint:  # Phi-3: gate then up, as fuse() lays them out
            self.gate_up_proj = Projection(spec.hidden_size, 2 * size, False)
        else:
            self.gate_proj = Projection(spec.hidden_size, size, False)
            self.up_proj = Projection(spec.hidden_size, size, False)
        self.down_proj = Projection(size, spec.hidden_size, False)
        self.act = spec.hidden_act
        if self.act not in ACTIVATIONS:
            raise ValueError(f"hidden activation {self.act!r} is not supported")
        self.fused_act = False  # silu(gate) * up in one C++ pass

    def fuse(self) -> None:
        if hasattr(self, "gate_up_proj"):
            self.gate_up = self.gate_up_proj
            del self.gate_up_proj
            self.gate_up.transpose()
        else:
            self.gate_up = Projection.fused([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj
        self.down_proj.transpose()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_act:
            hidden = self.gate_up.silu_and_mul(x)
        else:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            hidden = ACTIVATIONS[self.act](gate) * up
        return self.collectives.all_reduce(self.down_proj(hidden))


class DecoderLayer(nn.Module):
    def __init__(
        self, spec: ModelSpec, shards: RankShards, collectives: Collectives, index: int
    ) -> None:
        super().__init__()
        self.self_attn = Attention(spec, shards, collectives, index)
        # The feed-forward block, under its checkpoint name: the experts of a mixture
        # (Mixtral calls them block_sparse_moe), or the dense MLP.
        self.ffn_name = "mlp"
        if spec.is_sparse(index):
            if spec.architecture == "MixtralForCausalLM":
                self.ffn_name = "block_sparse_moe"
            self.add_module(self.ffn_name, SparseMoE(spec, shards, collectives))
        else:
            self.mlp = MLP(spec, shards, collectives)
        # Llama: each block's input normalised (the "post-attention" norm is the MLP's
        # input norm). OLMo 2: each block's output instead; Gemma: both (sandwich norms).
        # Those two apply the weight in float32, Gemma's as 1 + weight.
        size, eps, offset = spec.hidden_size, spec.rms_norm_eps, spec.norm_offset
        self.post_norms = spec.post_norms or spec.sandwich_norms
        self.pre_norms = spec.sandwich_norms
        if self.post_norms:
            self.post_attention_layernorm = RMSNorm(size, eps, True, offset)
            self.post_feedforward_layernorm = RMSNorm(size, eps, True, offset)
        if self.pre_norms:
            self.input_layernorm = RMSNorm(size, eps, True, offset)
            self.pre_feedforward_layernorm = RMSNorm(size, eps, True, offset)
        if not self.post_norms:
            self.input_layernorm = RMSNorm(size, eps)
            self.post_attention_layernorm = RMSNorm(size, eps)
        self.residual_multiplier = spec.residual_multiplier  # Granite's; 1.0 elsewhere

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings for the first layer), not yet
        added to the residual stream; returns this layer's MLP output and the stream."""
        if self.post_norms:
            stream = x if residual is None else residual + x
            hidden = self.input_layernorm(stream)[0] if self.pre_norms else stream
            attn = self.self_attn(hidden, cos, sin, kv_cache, meta)
            stream = stream + self.post_attention_layernorm(attn)[0]
            hidden = self.pre_feedforward_layernorm(stream)[0] if self.pre_norms else stream
            return self.post_feedforward_layernorm(self.ffn(hidden))[0], stream
        hidden, residual = self.input_layernorm(x, residual)
        attn = self.self_attn(hidden, cos, sin, kv_cache, meta)
        if self.residual_multiplier != 1.0:
            attn = attn * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(attn, residual)
        out = self.ffn(hidden)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return out, residual

    @property
    def ffn(self) -> MLP | SparseMoE:
        block: MLP | SparseMoE = getattr(self, self.ffn_name)
        return block


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds: keeps the layer numbering of the checkpoint."""


class LlamaModel(nn.Module):
    embed_tokens: nn.Embedding | None
    norm: RMSNorm | None

    def __init__(self, spec: ModelSpec, shards: RankShards, collectives: Collectives) -> None:
        super().__init__()
        layout = shards.layout
        self.embed_tokens = None
        if layout.is_first_stage:
            # Given a weight, nn.Embedding skips its random init: on the meta device that
            # init goes through torch's reference ops, which import torch._dynamo (a second
            # or more). Under tensor parallelism, this rank's vocabulary rows.
            rows = shards.vocab_per_rank
            weight = torch.empty(rows, spec.hidden_size)
            self.embed_tokens = nn.Embedding(rows, spec.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, shards, collectives, i) if shards.has_layer(i) else MissingLayer()
            for i in range(spec.num_layers)
        )
        self.norm = None
        if layout.is_last_stage:
            in_float32 = spec.post_norms or spec.sandwich_norms
            self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, in_float32, spec.norm_offset)

    def local_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]


class LlamaForCausalLM(nn.Module):
    """The whole model, or one rank's share of it (`collectives`: tensor and pipeline
    parallelism, engine_svc/models/sharding.py)."""

    lm_head: Projection | None

    def __init__(self, spec: ModelSpec, collectives: Collectives = SINGLE) -> None:
        super().__init__()
        self.spec = spec
        self.collectives = collectives
        self.shards = RankShards.of(spec, collectives.layout)
        self.model = LlamaModel(spec, self.shards, collectives)
        self.rotary = RotaryEmbedding(
            spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling
        )
        # Gemma 3: the windowed layers rotate by their own base (None: by the global one).
        self.local_rotary: RotaryEmbedding | None = None
        if spec.local_rope_theta is not None and spec.window_layers:
            self.local_rotary = RotaryEmbedding(
                spec.head_dim,
                spec.max_position_embeddings,
                spec.local_rope_theta,
                spec.local_rope_scaling,
            )
        self.lm_head = None
        if collectives.layout.is_last_stage:
            self.lm_head = Projection(spec.hidden_size, self.shards.vocab_per_rank, False)
        # The C++ CPU kernels' passes, and their loop over the layers for decode steps
        # (engine_svc/models/fast_paths.py sets them).
        self.fused_ops = False
        self.decode_layers: DecodeLayers | None = None

    def finish_loading(self) -> None:
        embed = self.model.embed_tokens
        if self.spec.tie_word_embeddings and self.lm_head is not None and embed is not None:
            self.lm_head.weight = embed.weight  # type: ignore[assignment]
            self.lm_head.shared_weight = True
        for layer in self.model.local_layers():
            layer.self_attn.fuse()
            layer.ffn.fuse()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states on the last pipeline stage; on the others, what the next
        stage takes as `intermediate`: the last layer's output and the residual stream,
        stacked [2, tokens, hidden]."""
        if intermediate is None:
            x = self.embed(input_ids)
            residual: torch.Tensor | None = None
        else:
            x, residual = intermediate[0], intermediate[1]
        tables = self._rotary_tables(self.rotary, positions, x.dtype)
        local_tables = tables
        if self.local_rotary is not None:
            local_tables = self._rotary_tables(self.local_rotary, positions, x.dtype)
        if self.decode_layers is not None and self.decode_layers.serves(meta, len(x)):
            x, residual = self.decode_layers(x, residual, tables, kv_caches, meta)
        else:
            for layer, kv_cache in zip(self.model.local_layers(), kv_caches, strict=True):
                cos, sin = tables if layer.self_attn.window is None else local_tables
                x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        if self.model.norm is None:
            assert residual is not None
            return torch.stack((x, residual))
        return self.model.norm(x, residual)[0]

    def _rotary_tables(
        self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_ops:
            return rotary.cos_sin_rows(positions)
        return rotary.cos_sin(positions, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embed = self.model.embed_tokens
        assert embed is not None, "only the first pipeline stage embeds"
        if self.collectives.layout.tp_size == 1:
            x = embed(input_ids)
        else:  # each rank looks up the ids in its rows; the sum over ranks has them all
            start, end = self.shards.vocab_rows
            mine = (input_ids >= start) & (input_ids < end)
            x = embed(torch.where(mine, input_ids - start, 0))
            x = self.collectives.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))
        multiplier = self.spec.embedding_multiplier
        if self.spec.embedding_multiplier_in_dtype:  # Gemma: sqrt(hidden) as the dtype has it
            return x * torch.tensor(multiplier, dtype=x.dtype, device=x.device)
        if multiplier != 1.0:
            x = x * multiplier
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        logits = self.lm_head(hidden)
        if self.collectives.layout.tp_size > 1:
            logits = self.collectives.all_gather_last_dim(logits)[:, : self.spec.vocab_size]
        if self.spec.logits_scaling != 1.0:
            logits = logits / self.spec.logits_scaling
        cap = self.spec.final_logit_softcapping
        if cap is not None:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits
