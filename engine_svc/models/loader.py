"""Build a model from a Hugging Face directory: config.json plus safetensors weights."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from engine_svc.models.llama import LlamaForCausalLM
from engine_svc.models.model_spec import ModelSpec

logger = logging.getLogger(__name__)


def load_model(
    model_dir: str | Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(spec)
    params = dict(model.named_parameters())
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in params:
                    state[name] = handle.get_tensor(name).to(dtype=dtype, device=device)
    if spec.tie_word_embeddings:
        params.pop("lm_head.weight", None)
        state.pop("lm_head.weight", None)
    missing = sorted(set(params) - set(state))
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    model.rotary.to(device)  # its tables were computed on the CPU, meta context or not
    model.finish_loading()
    model.eval().requires_grad_(False)
    num_params = sum(t.numel() for t in state.values())
    logger.info(
        "loaded %s: %.1fM parameters as %s on %s",
        spec.architecture,
        num_params / 1e6,
        dtype,
        device,
    )
    return model
