"""Build a model from a Hugging Face directory: config.json plus safetensors weights."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine_svc.distributed.collectives import SINGLE, Collectives
from engine_svc.models.llama import LlamaForCausalLM
from engine_svc.models.model_spec import ModelSpec
from engine_svc.models.sharding import RankShards

logger = logging.getLogger(__name__)


def load_model(
    model_dir: str | Path,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    collectives: Collectives = SINGLE,
) -> LlamaForCausalLM:
    """The model, or under tensor/pipeline parallelism this rank's share of it: each tensor
    is read from the checkpoint as the rows this rank holds, never whole."""
    with torch.device("meta"):
        model = LlamaForCausalLM(spec, collectives)
    params = dict(model.named_parameters())
    # Tied embeddings: the LM head is the embedding, shared after loading, or read from the
    # embedding's tensor on a last pipeline stage that does not hold the embedding.
    sources = {name: name for name in params}
    if spec.tie_word_embeddings and "lm_head.weight" in params:
        if "model.embed_tokens.weight" in params:
            del params["lm_head.weight"], sources["lm_head.weight"]
        else:
            sources["lm_head.weight"] = "model.embed_tokens.weight"
    wanted = {source: name for name, source in sources.items()}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for source in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = wanted.get(source)
                if name is not None:
                    tensor = _read_share(handle, source, model.shards, spec, params[name].shape)
                    state[name] = tensor.to(dtype=dtype, device=device)
    missing = sorted(set(params) - set(state))
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    # The rotary tables were computed on the CPU, meta context or not.
    model.rotary.to(device)
    if model.local_rotary is not None:
        model.local_rotary.to(device)
    model.finish_loading()
    model.eval().requires_grad_(False)
    num_params = sum(t.numel() for t in state.values())
    layout = collectives.layout
    share = "" if layout.world_size == 1 else f" (rank {layout.rank}'s share)"
    logger.info(
        "loaded %s: %.1fM parameters%s as %s on %s",
        spec.architecture,
        num_params / 1e6,
        share,
        dtype,
        device,
    )
    return model


def _read_share(
    handle: Any, name: str, shards: RankShards, spec: ModelSpec, shape: torch.Size
) -> torch.Tensor:
    """This rank's rows of checkpoint tensor `name`, zero-padded to the parameter's shape
    (the last vocabulary share may be short)."""
    share = shards.slices(name, spec)
    if share is None:
        return handle.get_tensor(name)
    dim, pieces = share
    whole = handle.get_slice(name)
    parts = [whole[start:end] if dim == 0 else whole[:, start:end] for start, end in pieces]
    tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    if tensor.shape[0] < shape[0]:
        padding = torch.zeros(shape[0] - tensor.shape[0], *tensor.shape[1:], dtype=tensor.dtype)
        tensor = torch.cat([tensor, padding])
    return tensor
