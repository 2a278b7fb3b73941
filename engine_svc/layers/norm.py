"""RMSNorm as the Llama families compute it, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm, optionally after adding the residual stream (which it then returns too).
    `fused`: one C++ pass on CPU (engine_svc/kernels) instead of torch's five to eight."""

    def __init__(
        self, size: int, eps: float, weight_in_float32: bool = False, offset: float = 0.0
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = False
        # OLMo 2 and Gemma multiply by the weight in float32 and cast after; the others cast
        # the normalised value first (the same in float32, not in bfloat16).
        self.weight_in_float32 = weight_in_float32
        # Gemma scales by 1 + weight (its checkpoints hold the difference from 1).
        self.offset = offset

    def fuse(self) -> None:
        """Run as the C++ pass (float32 only where the weight applies in float32), with the
        offset folded into the weight: the same float32 sum Gemma computes at every call."""
        self.fused = True
        if self.offset:
            self.weight = nn.Parameter(self.offset + self.weight.detach().float())
            self.offset = 0.0

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); with no residual, (norm(x), x)."""
        if self.fused:
            if residual is None:
                return torch.ops.duoserve.rms_norm(x, self.weight, self.eps), x
            summed, normed = torch.ops.duoserve.add_rms_norm(x, residual, self.weight, self.eps)
            return normed, summed
        if residual is not None:
            x = residual + x  # Hugging Face's order
        # Computed in float32 then cast back, exactly as Hugging Face does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_float32:
            scale = self.weight.float() + self.offset if self.offset else self.weight.float()
            return (x32 * scale).to(x.dtype), x
        return self.weight * x32.to(x.dtype), x
