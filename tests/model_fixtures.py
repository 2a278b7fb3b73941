"""A tiny Llama with random weights and the default model's tokenizer, saved like a real one.

Tests that need speed use it; the same loading code serves it and the default model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_model(out_dir: Path, default_model_dir: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # Wide weights make the random model's logits peaky: near-ties between the top two
        # tokens would turn float rounding into spurious mismatches against HF.
        initializer_range=0.25,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        source = default_model_dir / name
        if source.is_file():
            shutil.copy(source, out_dir / name)
    return out_dir
