"""Rotary position embeddings (the Hugging Face `rotate_half` layout), cached per position."""

from __future__ import annotations

import math
from typing import Any

import torch


def _default_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta**exponents)


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """The frequencies of every position (for `longrope`, of those within the original
    context: `rope_tables` switches past it)."""
    inv_freq = _default_frequencies(head_dim, theta)
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    if rope_type == "dynamic":
        # Dynamic NTK changes the base only past max_position_embeddings, which the engine's
        # max_model_len never exceeds: within it the frequencies are the default ones.
        return inv_freq
    if rope_type == "yarn":
        return _yarn_frequencies(head_dim, theta, scaling)
    if rope_type == "longrope":
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32, device="cpu")
    raise ValueError(f"rope scaling {rope_type!r} is not supported")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen = old_context / low_freq_factor
    high_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def attention_factor(scaling: dict[str, Any] | None, max_position_embeddings: int) -> float:
    """What yarn and longrope multiply cos and sin by (1 for the other types)."""
    if scaling is None:
        return 1.0
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if scaling.get("attention_factor") is not None and rope_type in ("yarn", "longrope"):
        return float(scaling["attention_factor"])
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    if rope_type == "yarn":
        factor = scaling.get("factor") or max_position_embeddings / original
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        return _yarn_mscale(factor)
    if rope_type == "longrope":
        factor = scaling.get("factor") or max_position_embeddings / original
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Interpolated (divided by `factor`) where a dimension turns fewer than `beta_slow`
    times over the original context, extrapolated (unchanged) where more than `beta_fast`,
    blended linearly between."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling["factor"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = (
        (torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    ).clamp(0, 1)
    extrapolation = _default_frequencies(head_dim, theta)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return extrapolation / factor * (1 - keep) + extrapolation * keep


class RotaryEmbedding(torch.nn.Module):
    """cos and sin tables for every position, computed on the CPU (also inside a meta-device
    context, where torch's reference ops would import torch._dynamo: over a second of
    start-up); `.to(device)` moves them."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inverse_frequencies(head_dim, theta, scaling))
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
            # Past the original context, the long factors (as vLLM does: a sequence within
            # it is exactly what transformers computes).
            original = scaling["original_max_position_embeddings"]
            long = _default_frequencies(head_dim, theta) / torch.tensor(
                scaling["long_factor"], dtype=torch.float32, device="cpu"
            )
            freqs[original:] = torch.outer(positions[original:], long)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(scaling, max_positions)
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cos and sin, shaped to broadcast over heads: [tokens, 1, head_dim]."""
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    def cos_sin_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cos and sin as float32 [tokens, head_dim], for the fused CPU kernel
        (which casts them to the model dtype as `cos_sin` does)."""
        return self.cos_cache.index_select(0, positions), self.sin_cache.index_select(0, positions)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
