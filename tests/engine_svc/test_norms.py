"""RMSNorm in bfloat16 rounds where each family's transformers code rounds: Llama casts the
normalised value to bfloat16 before the weight, OLMo 2 multiplies by the weight in float32
and casts after. The family tests run float32, where the two orders agree."""

from __future__ import annotations

import pytest
import torch

from engine_svc.layers.norm import RMSNorm


@pytest.mark.parametrize(("module", "name", "weight_in_float32"), [
    ("llama", "LlamaRMSNorm", False), ("olmo2", "Olmo2RMSNorm", True),
])  # fmt: skip
def test_bfloat16_rms_norm_is_transformers_own(
    module: str, name: str, weight_in_float32: bool
) -> None:
    import importlib

    reference_class = getattr(
        importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name
    )
    torch.manual_seed(0)
    x = torch.randn(64, 96).to(torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(96)).to(torch.bfloat16)
    reference = reference_class(96, eps=1e-6).to(torch.bfloat16)
    reference.weight.data.copy_(weight)
    ours = RMSNorm(96, 1e-6, weight_in_float32).to(torch.bfloat16)
    ours.weight.data.copy_(weight)
    with torch.no_grad():
        assert torch.equal(ours(x)[0], reference(x))
        # The other order rounds differently somewhere in 64 x 96 values.
        other = RMSNorm(96, 1e-6, not weight_in_float32).to(torch.bfloat16)
        other.weight.data.copy_(weight)
        assert not torch.equal(other(x)[0], reference(x))
