"""A pure decode step through all of a model's decoder layers in one C++ call
(`duoserve::decode_layers`, engine_svc/kernels/csrc/decode_layers.cpp).

With the CPU kernels on, a Llama-style layer is about fourteen operators, and in a decode
step each is small: for one request, the Python that calls them (module calls, views, the
dispatcher's argument parsing) took about a third of the step while the second OpenMP
thread spun. The C++ loop runs the same operators on the same tensors in the same order,
so its outputs are the Python path's bit for bit. It serves the layers it can describe:
pre-norm layers with the fused kernels on (RMSNorm, rotary, silu * up), a dense MLP, no
q/k norms, clipping, soft-capping or residual multiplier, one tensor-parallel rank, one
rotary table; other models, and steps with prompt tokens, keep the Python loop.
"""

from __future__ import annotations

import torch

from engine_svc.layers.attention import AttentionMetadata
from engine_svc.models.llama import MLP, DecoderLayer, KVCache, LlamaForCausalLM


def layer_supported(layer: DecoderLayer) -> bool:
    """Whether decode_layers.cpp computes what this layer's forward does."""
    attn, ffn = layer.self_attn, layer.ffn
    return (
        not layer.post_norms
        and not layer.pre_norms
        and layer.residual_multiplier == 1.0
        and layer.input_layernorm.fused
        and layer.post_attention_layernorm.fused
        and attn.fused_rotary
        and attn.q_norm is None
        and attn.k_norm is None
        and attn.clip_qkv is None
        and attn.softcap is None
        and isinstance(ffn, MLP)
        and ffn.fused_act
    )


class DecodeLayers:
    """The C++ loop's description of a model's layers; `of(model)` is None for a model it
    does not serve. It holds the projections' weights as they are when it is built (after
    use_fused_ops chose their layouts): a model whose weights change must build it again."""

    def __init__(self, layers: list[DecoderLayer]) -> None:
        self.weights: list[list[torch.Tensor | None]] = []
        self.ints: list[int] = []
        self.floats: list[float] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.ffn
            assert isinstance(mlp, MLP)  # layer_supported's
            tensors: list[torch.Tensor | None] = [
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
            ]
            ints = [attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.window or 0]
            for projection in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj):
                projection_tensors, projection_ints = projection.kernel_args()
                tensors += projection_tensors
                ints += projection_ints
            self.weights.append(tensors)
            self.ints += ints
            self.floats += [
                layer.input_layernorm.eps,
                layer.post_attention_layernorm.eps,
                attn.scale,
            ]

    @classmethod
    def of(cls, model: LlamaForCausalLM) -> DecodeLayers | None:
        layers = model.model.local_layers()
        if (
            not model.fused_ops
            or model.collectives.layout.tp_size != 1
            or model.local_rotary is not None
            or not layers
            or not all(layer_supported(layer) for layer in layers)
        ):
            return None
        return cls(layers)

    @staticmethod
    def serves(meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether a step is one the loop runs: decodes only, through the decode kernel."""
        return (
            not meta.prefills
            and meta.prefill_kernel is None
            and meta.decode_kernel is not None
            and meta.decode_block_tables is not None
            and meta.num_decodes == num_tokens
        )

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        tables: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output and the residual stream, as the Python loop returns."""
        assert meta.decode_kernel is not None and meta.decode_block_tables is not None
        cos, sin = tables
        out: tuple[torch.Tensor, torch.Tensor] = torch.ops.duoserve.decode_layers(
            x,
            residual,
            cos,
            sin,
            self._with_caches(kv_caches),
            self.ints,
            self.floats,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_kernel.context_lens,
            meta.decode_kernel.max_context_len,
        )
        return out

    def _with_caches(self, kv_caches: list[KVCache]) -> list[torch.Tensor | None]:
        """The flat tensor list with this step's caches in their places. Built at every
        step (a few microseconds): a list kept between steps would hold caches the runner
        replaced."""
        tensors: list[torch.Tensor | None] = []
        for weights, (k_cache, v_cache) in zip(self.weights, kv_caches, strict=True):
            tensors += [*weights[:2], k_cache, v_cache, *weights[2:]]
        return tensors
