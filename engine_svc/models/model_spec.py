"""A model's shape, read from its Hugging Face `config.json` (no transformers import)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
# Families whose attention projections carry a bias unless their config says otherwise.
_BIASED_BY_DEFAULT = ("Qwen2ForCausalLM",)
# Families that RMS-normalise each head of q and k before the rotary embedding.
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
# Gemma: norms scale by 1 + weight in float32, before and after attention and the MLP; the
# embeddings are scaled by sqrt(hidden_size) rounded to the model's dtype.
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Families that RMS-normalise q and k whole (every head's dims together) before the rotary.
_QK_NORM_WHOLE = ("Olmo2ForCausalLM", "OlmoeForCausalLM")
# Families whose layers normalise each block's output (post-norms) instead of its input.
_POST_NORMS = ("Olmo2ForCausalLM",)
# Families whose checkpoints hold q/k/v as one qkv_proj and gate/up as one gate_up_proj.
_FUSED_CHECKPOINT = ("Phi3ForCausalLM",)
_GEMMA_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
}
_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": {**_GEMMA_DEFAULTS, "rope_theta": 10000.0,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "Gemma3ForCausalLM": {**_GEMMA_DEFAULTS, "rope_theta": 1_000_000.0,
                          "rope_local_base_freq": 10000.0},
    "MistralForCausalLM": {"sliding_window": 4096},
    "Qwen2ForCausalLM": {"use_sliding_window": False},
    "Qwen3ForCausalLM": {"use_sliding_window": False},
    "Qwen3MoeForCausalLM": {"use_sliding_window": False},
}  # fmt: skip
# Families whose every layer attends over the config's sliding_window, when it names one.
_WINDOW_IN_EVERY_LAYER = (
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
# Families whose layer_types say which layers are windowed, and the default where a config
# predates layer_types: (layer index, config) -> windowed.
_WINDOW_BY_LAYER_TYPE: dict[str, Callable[[int, dict[str, Any]], bool]] = {
    "Qwen2ForCausalLM": lambda i, config: i >= config.get("max_window_layers", 28),
    "Qwen3ForCausalLM": lambda i, config: i >= config.get("max_window_layers", 28),
    "Gemma2ForCausalLM": lambda i, config: i % 2 == 0,
    "Gemma3ForCausalLM": lambda i, config: (i + 1) % config.get("sliding_window_pattern", 6) != 0,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before the rotary embedding (Qwen3)
    # Tokens each query attends back over in the windowed layers, itself included (the
    # config's sliding_window); None: every layer attends over all earlier tokens.
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    is_causal: bool  # False: the prompt attends both ways (prefix-LM)
    torch_dtype: str
    window_layers: tuple[int, ...] = ()  # the layers that attend over sliding_window only
    fused_checkpoint: bool = False  # qkv_proj and gate_up_proj weights (Phi-3)
    qk_norm_whole: bool = False  # RMSNorm of all of q and of all of k (OLMo 2)
    post_norms: bool = False  # norm after attention and MLP, none before (OLMo 2)
    clip_qkv: float | None = None  # q, k and v clamped to +-clip_qkv (OLMoE)
    # Mixture of experts (Mixtral, Qwen3-MoE, OLMoE); 0 experts: every layer is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k scores renormalised to sum to 1
    sparse_layers: tuple[int, ...] = ()  # the layers whose MLP is the experts

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    # Granite's multipliers (1.0 and None elsewhere): the embeddings are scaled, each block's
    # output is scaled before it joins the residual stream, attention scores are scaled by
    # attention_multiplier instead of 1/sqrt(head_dim), and the logits divided.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0

    hidden_act: str = "silu"  # the MLP's gate activation (Gemma: gelu_pytorch_tanh)
    # Gemma: the norms' scale is 1 + weight (in float32); layers norm each block's input
    # and output (sandwich norms); the embedding multiplier is rounded to the model dtype.
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embedding_multiplier_in_dtype: bool = False
    # Gemma 2: attention scores and final logits squashed by cap * tanh(x / cap).
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 3: the windowed layers' own rotary base and scaling (None: the global ones).
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None

    def window_of(self, layer: int) -> int | None:
        """The tokens layer `layer` attends back over; None: all of them."""
        return self.sliding_window if layer in self.window_layers else None

    @property
    def attention_span(self) -> int | None:
        """The most tokens back that any layer reads: where every layer is windowed, KV
        blocks older than that can be released. None: some layer reads them all."""
        if len(self.window_layers) < self.num_layers:
            return None
        return self.sliding_window

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, before the element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model dir")
    config = json.loads(config_path.read_text())
    architecture = (config.get("architectures") or ["?"])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    # What the family's transformers config class assumes where config.json is silent
    # (Hub configs written by older transformers leave defaults out).
    config = {**_CONFIG_DEFAULTS.get(architecture, {}), **config}
    num_heads = config["num_attention_heads"]
    hidden_size = config["hidden_size"]
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    local_rope: dict[str, Any] = {}
    if "full_attention" in rope:  # Gemma 3: one rotary per kind of layer
        local_rope = dict(rope.get("sliding_attention") or {})
        rope = dict(rope["full_attention"] or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if architecture == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = rope["rope_type"] = "longrope"  # Phi-3's older names for it
    if rope_type in ("longrope", "yarn") and "original_max_position_embeddings" not in rope:
        # Phi-3 long-context checkpoints keep it beside the rope dict (4096 by default).
        default = 4096 if architecture == "Phi3ForCausalLM" else None
        rope["original_max_position_embeddings"] = config.get(
            "original_max_position_embeddings", default or config.get("max_position_embeddings")
        )
    if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) not in (
        1.0,
        None,
    ):
        raise ValueError(f"{architecture}: a partial_rotary_factor is not supported")
    granite = architecture == "GraniteForCausalLM"
    gemma = architecture in _GEMMA
    is_causal = not config.get("use_bidirectional_attention", False)
    window, window_layers = _windows(architecture, config)
    if window is not None and not is_causal:
        raise ValueError(
            f"{architecture}: a sliding window over bidirectional attention is not supported"
        )
    return ModelSpec(
        architecture=architecture,
        vocab_size=config["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or hidden_size // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        rope_scaling=None if rope_type == "default" else dict(rope),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        attention_bias=config.get("attention_bias", architecture in _BIASED_BY_DEFAULT),
        qk_norm=architecture in _QK_NORM,
        sliding_window=window,
        eos_token_ids=_eos_ids(model_dir, config),
        is_causal=is_causal,
        torch_dtype=config.get("dtype") or config.get("torch_dtype") or "float32",
        window_layers=window_layers,
        fused_checkpoint=architecture in _FUSED_CHECKPOINT,
        qk_norm_whole=architecture in _QK_NORM_WHOLE,
        post_norms=architecture in _POST_NORMS,
        clip_qkv=config.get("clip_qkv"),
        **_experts(architecture, config),
        **(_granite(config) if granite else {}),
        **(_gemma(config, hidden_size, local_rope) if gemma else {}),
    )


def _granite(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "embedding_multiplier": config.get("embedding_multiplier", 1.0),
        "residual_multiplier": config.get("residual_multiplier", 1.0),
        "attention_multiplier": config.get("attention_multiplier"),
        "logits_scaling": config.get("logits_scaling", 1.0),
    }


def _gemma(config: dict[str, Any], hidden_size: int, local_rope: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 and 3's traits (the family defaults filled in, _CONFIG_DEFAULTS)."""
    local_type = local_rope.get("rope_type", local_rope.get("type", "default"))
    return {
        "hidden_act": config.get("hidden_activation")
        or config.get("hidden_act")
        or "gelu_pytorch_tanh",
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "embedding_multiplier": hidden_size**0.5,
        "embedding_multiplier_in_dtype": True,
        "attention_multiplier": config["query_pre_attn_scalar"] ** -0.5,
        # Gemma 2 caps both unless its config says otherwise; Gemma 3 neither.
        "attn_logit_softcapping": config.get("attn_logit_softcapping"),
        "final_logit_softcapping": config.get("final_logit_softcapping"),
        "local_rope_theta": local_rope.get("rope_theta", config.get("rope_local_base_freq")),
        "local_rope_scaling": None if local_type == "default" else local_rope,
    }


def _experts(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields: which layers are sparse, with how many experts."""
    num_experts = config.get("num_local_experts") or config.get("num_experts") or 0
    if not num_experts:
        return {}
    layers = range(config["num_hidden_layers"])
    if architecture == "Qwen3MoeForCausalLM":  # some layers may stay dense
        step = config.get("decoder_sparse_step") or 1
        dense = set(config.get("mlp_only_layers") or [])
        sparse = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
    else:
        sparse = tuple(layers)
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": config["num_experts_per_tok"],
        "moe_intermediate_size": config.get("moe_intermediate_size") or config["intermediate_size"],
        # Mixtral always renormalises the top-k scores; the others say whether they do.
        "norm_topk_prob": architecture == "MixtralForCausalLM"
        or bool(config.get("norm_topk_prob", False)),
        "sparse_layers": sparse,
    }


def _windows(architecture: str, config: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """The attention window and the layers it applies to, as transformers reads them for
    the family: Qwen2 and Qwen3 name a window but leave it off unless use_sliding_window;
    Llama, Granite, OLMo 2 and OLMoE ignore it."""
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window", True) is False:
        return None, ()
    layers = range(config["num_hidden_layers"])
    if architecture in _WINDOW_IN_EVERY_LAYER:
        return int(window), tuple(layers)
    if architecture not in _WINDOW_BY_LAYER_TYPE:
        return None, ()
    types = config.get("layer_types")
    if types is not None:
        windowed = tuple(i for i in layers if types[i] == "sliding_attention")
    else:
        windowed = tuple(i for i in layers if _WINDOW_BY_LAYER_TYPE[architecture](i, config))
    return (int(window), windowed) if windowed else (None, ())


def _eos_ids(model_dir: Path, config: dict[str, Any]) -> tuple[int, ...]:
    # generation_config.json is what `generate` stops on; it wins over config.json.
    ids: list[int] = []
    generation_path = model_dir / "generation_config.json"
    sources = [config]
    if generation_path.is_file():
        sources.insert(0, json.loads(generation_path.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        if value is not None:
            ids = value if isinstance(value, list) else [value]
            break
    return tuple(ids)
