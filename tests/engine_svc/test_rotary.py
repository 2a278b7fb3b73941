"""Rotary tables for the scaling types transformers defines; the families' tests
(test_model_families.py) check each against transformers end to end. Here: what those tests
cannot reach, longrope past the original context, and a type the engine refuses."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine_svc.layers.rotary import RotaryEmbedding, attention_factor
from engine_svc.models.model_spec import load_model_spec

HEAD_DIM, THETA = 8, 10000.0
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.5, 2.0, 2.5],
    "long_factor": [3.0, 4.0, 5.0, 6.0],
    "original_max_position_embeddings": 64,
}


def _expected_cos(position: int, factors: list[float], scale: float) -> torch.Tensor:
    base = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = position * base / torch.tensor(factors)
    return torch.cat((angles, angles)).cos() * scale


def test_longrope_uses_the_short_factors_within_the_original_context_and_long_past_it() -> None:
    rotary = RotaryEmbedding(HEAD_DIM, 256, THETA, LONGROPE)
    scale = math.sqrt(1 + math.log(256 / 64) / math.log(64))  # max positions / original
    assert attention_factor(LONGROPE, 256) == pytest.approx(scale)
    for position, factors in ((0, "short_factor"), (63, "short_factor"), (64, "long_factor"),
                              (200, "long_factor")):  # fmt: skip
        expected = _expected_cos(position, LONGROPE[factors], scale)  # type: ignore[arg-type]
        torch.testing.assert_close(rotary.cos_cache[position], expected)


def test_yarn_scales_cos_and_sin_by_its_attention_factor() -> None:
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    assert attention_factor(yarn, 128) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert attention_factor({**yarn, "attention_factor": 0.5}, 128) == 0.5
    rotary = RotaryEmbedding(HEAD_DIM, 128, THETA, yarn)
    norms = rotary.cos_cache.square() + rotary.sin_cache.square()
    torch.testing.assert_close(norms, torch.full_like(norms, attention_factor(yarn, 128) ** 2))


def test_an_unknown_scaling_type_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'su'"):
        RotaryEmbedding(HEAD_DIM, 64, THETA, {"rope_type": "su", "factor": 2.0})


def test_phi3_long_context_configs_read_as_transformers_reads_them(tmp_path: Path) -> None:
    """Phi-3 128k checkpoints: rope type "su" (an older name of longrope), and
    original_max_position_embeddings beside the rope dict, not in it."""
    config = {
        "architectures": ["Phi3ForCausalLM"], "vocab_size": 100, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = load_model_spec(tmp_path)
    assert spec.rope_scaling is not None
    assert spec.rope_scaling["rope_type"] == "longrope"
    assert spec.rope_scaling["original_max_position_embeddings"] == 4096
    expected = math.sqrt(1 + math.log(131072 / 4096) / math.log(4096))
    assert attention_factor(spec.rope_scaling, 131072) == pytest.approx(expected)
