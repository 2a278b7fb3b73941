"""Which layers attend over a sliding window, read from config.json as checkpoints on the Hub
write it (older ones have no layer_types), and Gemma's traits where a config leaves the
family's defaults out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine_svc.models.model_spec import ModelSpec, load_model_spec

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4}  # fmt: skip


def _spec(tmp_path: Path, architecture: str, **config: Any) -> ModelSpec:
    (tmp_path / "config.json").write_text(
        json.dumps({**BASE, "architectures": [architecture], **config})
    )
    return load_model_spec(tmp_path)


@pytest.mark.parametrize(
    ("architecture", "config", "window_layers"),
    [
        ("MistralForCausalLM", {"sliding_window": 4096}, (0, 1, 2, 3)),
        ("MistralForCausalLM", {}, (0, 1, 2, 3)),  # MistralConfig's default window, 4096
        ("MistralForCausalLM", {"sliding_window": None}, ()),
        ("Phi3ForCausalLM", {"sliding_window": 2047}, (0, 1, 2, 3)),
        # Qwen2/Qwen3 name a window but use it only with use_sliding_window, from
        # max_window_layers on (28 when absent), or where layer_types says.
        ("Qwen2ForCausalLM", {"sliding_window": 4096, "use_sliding_window": False}, ()),
        (
            "Qwen2ForCausalLM",
            {"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2},
            (2, 3),
        ),
        ("Qwen2ForCausalLM", {"sliding_window": 64, "use_sliding_window": True}, ()),
        ("Qwen2ForCausalLM", {"sliding_window": 64, "max_window_layers": 0}, ()),  # off
        (
            "Qwen3MoeForCausalLM",
            {"sliding_window": 64, "num_experts": 4, "num_experts_per_tok": 2},
            (),
        ),
        (
            "Qwen3ForCausalLM",
            {
                "sliding_window": 64,
                "use_sliding_window": True,
                "layer_types": ["full_attention", "sliding_attention"] * 2,
            },
            (1, 3),
        ),
        # transformers' Llama and OLMoE ignore a window in their config.
        ("LlamaForCausalLM", {"sliding_window": 64}, ()),
        (
            "OlmoeForCausalLM",
            {"sliding_window": 64, "num_experts": 4, "num_experts_per_tok": 2},
            (),
        ),
        # Gemma 2: every other layer from 0; Gemma 3: all but every sixth.
        ("Gemma2ForCausalLM", {"sliding_window": 4096}, (0, 2)),
        (
            "Gemma3ForCausalLM",
            {"sliding_window": 512, "num_hidden_layers": 12},
            (0, 1, 2, 3, 4, 6, 7, 8, 9, 10),
        ),
        ("Gemma3ForCausalLM", {"sliding_window": 512, "sliding_window_pattern": 2}, (0, 2)),
    ],
)
def test_the_windowed_layers_are_those_transformers_windows(
    tmp_path: Path, architecture: str, config: dict[str, Any], window_layers: tuple[int, ...]
) -> None:
    spec = _spec(tmp_path, architecture, **config)
    assert spec.window_layers == window_layers
    window = config.get("sliding_window", 4096)
    assert spec.sliding_window == (window if window_layers else None)
    every_layer = len(window_layers) == spec.num_layers
    assert spec.attention_span == (spec.sliding_window if every_layer else None)


def test_gemma2_caps_scores_and_logits_unless_its_config_says_otherwise(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "Gemma2ForCausalLM", sliding_window=4096, query_pre_attn_scalar=144)
    assert (spec.attn_logit_softcapping, spec.final_logit_softcapping) == (50.0, 30.0)
    assert spec.attention_multiplier == pytest.approx(144**-0.5)
    assert spec.hidden_act == "gelu_pytorch_tanh" and spec.embedding_multiplier == 8.0
    uncapped = _spec(tmp_path, "Gemma2ForCausalLM", attn_logit_softcapping=None,
                     final_logit_softcapping=None)  # fmt: skip
    assert (uncapped.attn_logit_softcapping, uncapped.final_logit_softcapping) == (None, None)


def test_gemma3_reads_its_local_rotary_as_hub_configs_write_it(tmp_path: Path) -> None:
    """Before rope_parameters: rope_theta for the global layers, scaled by rope_scaling, and
    rope_local_base_freq, unscaled, for the windowed ones."""
    spec = _spec(tmp_path, "Gemma3ForCausalLM", sliding_window=1024, rope_theta=1e6,
                 rope_local_base_freq=10000.0,
                 rope_scaling={"rope_type": "linear", "factor": 8.0})  # fmt: skip
    assert spec.rope_theta == 1e6 and spec.local_rope_theta == 10000.0
    assert spec.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert spec.local_rope_scaling is None
    assert spec.attn_logit_softcapping is None and spec.qk_norm


def test_a_window_over_bidirectional_attention_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bidirectional"):
        _spec(tmp_path, "Gemma3ForCausalLM", sliding_window=512, use_bidirectional_attention=True)


@pytest.mark.parametrize("architecture", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_a_gemma_config_that_leaves_the_defaults_out_gets_transformers_defaults(
    tmp_path: Path, architecture: str
) -> None:
    """Hub configs written by older transformers omit what the config class defaults:
    tied embeddings (else the missing lm_head.weight would stop the load), head_dim 256,
    a window of 4096, query_pre_attn_scalar 256, the rotary bases."""
    spec = _spec(tmp_path, architecture)
    assert spec.tie_word_embeddings and spec.head_dim == 256 and spec.sliding_window == 4096
    assert spec.attention_multiplier == pytest.approx(256**-0.5)
    if architecture == "Gemma3ForCausalLM":
        assert (spec.rope_theta, spec.local_rope_theta) == (1e6, 10000.0)
    else:
        assert spec.rope_theta == 10000.0 and spec.local_rope_theta is None
