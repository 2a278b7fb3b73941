"""The tiny random model of each family the engine serves, as the family's own transformers
config class builds it (2-3 layers, hidden size 64, GQA, a sliding window shorter than most
prompts where the family has one, several experts where it is a mixture). Shared by the
family tests and the parallel-executor tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

VOCAB_SIZE = 49152  # the default model's tokenizer, which the engine loads with the model
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    # Wide weights make the random model's logits peaky: near-ties between the top two tokens
    # would turn float rounding into spurious mismatches.
    "initializer_range": 0.25,
}


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**COMMON, tie_word_embeddings=True)


def _llama3_rope() -> Any:
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 500000.0}  # fmt: skip
    return LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters=rope)


def _yarn_rope() -> Any:
    from transformers import LlamaConfig

    # Longer sequences than the original context: yarn is the same at every length.
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
            "rope_theta": 10000.0}  # fmt: skip
    return LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters=rope)


def _dynamic_rope() -> Any:
    from transformers import LlamaConfig

    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    return LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters=rope)


WINDOW = 32  # shorter than most prompts here


def _mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(**COMMON, sliding_window=WINDOW)


def _gemma2() -> Any:
    from transformers import Gemma2Config

    # Layer 0 windowed, layer 1 global; caps low enough that tanh bends the random model's
    # scores and logits.
    return Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                        attn_logit_softcapping=5.0, final_logit_softcapping=20.0)  # fmt: skip


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    # Windowed, global, windowed; the global layer's rotary scaled (linear), the windowed
    # ones on their own base; q/k norms.
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
    }
    layers = ["sliding_attention", "full_attention", "sliding_attention"]
    config = {**COMMON, "num_hidden_layers": 3}
    return Gemma3TextConfig(**config, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                            layer_types=layers, rope_parameters=rope)  # fmt: skip


def _qwen2() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**COMMON, tie_word_embeddings=True)  # q, k and v carry a bias


def _qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True)  # q/k RMSNorm


def _phi3() -> Any:
    from transformers import Phi3Config

    return Phi3Config(**COMMON)  # qkv_proj and gate_up_proj in the checkpoint


def _phi3_longrope() -> Any:
    from transformers import Phi3Config

    # Sequences within the original context (short factors), a scaled cos and sin.
    half = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [2.0 + i for i in range(half)],
            "original_max_position_embeddings": 256}  # fmt: skip
    return Phi3Config(**COMMON, rope_parameters=rope, original_max_position_embeddings=256)


def _granite() -> Any:
    from transformers import GraniteConfig

    return GraniteConfig(**COMMON, embedding_multiplier=2.0, residual_multiplier=0.5,
                         attention_multiplier=0.2, logits_scaling=4.0)  # fmt: skip


def _olmo2() -> Any:
    from transformers import Olmo2Config

    return Olmo2Config(**COMMON)  # q and k normalised whole; post-norms in every layer


def _mixtral() -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    # Layer 1 stays dense (mlp_only_layers): both kinds of layer in one model.
    return Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1],
                          tie_word_embeddings=True)  # fmt: skip


def _olmoe() -> Any:
    from transformers import OlmoeConfig

    # clip_qkv low enough that the random model's q, k and v are clamped.
    return OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, clip_qkv=2.0)


FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "llama3_rope": _llama3_rope,
    "yarn_rope": _yarn_rope,
    "dynamic_rope": _dynamic_rope,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "phi3": _phi3,
    "phi3_longrope": _phi3_longrope,
    "granite": _granite,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "olmo2": _olmo2,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
}
