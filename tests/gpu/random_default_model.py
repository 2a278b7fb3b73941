"""The default model's shape with random weights, for a machine that cannot fetch the model
(the lent GPU machine reaches no registry): config, tokenizer and chat template copied from a
model directory, weights drawn by Hugging Face's initializer with a fixed seed, saved in the
config's dtype where shared.model_store would put the default model.

    python tests/gpu/random_default_model.py SOURCE_DIR

SOURCE_DIR needs the model's small files (config.json, tokenizer files), not its weights.
Speeds measured on it are the real model's (same shapes); its greedy tokens are not text.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shared.model_store import default_model_dir, is_complete_model_dir


def main(source: Path) -> Path:
    target = default_model_dir()
    # Random weights must never stand in for the real model in a user's cache.
    if not os.environ.get("DUOSERVE_CACHE"):
        sys.exit("set DUOSERVE_CACHE to a scratch folder: the model goes where it points")
    if is_complete_model_dir(target):
        sys.exit(f"{target} already holds a model; not replaced")
    target.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(source)
    torch.manual_seed(0)
    dtype = getattr(config, "dtype", None) or torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(target)
    for path in source.iterdir():
        weights = path.name.endswith((".safetensors", ".safetensors.index.json"))
        if path.is_file() and not weights and path.name != "config.json":
            shutil.copy(path, target / path.name)
    return target


if __name__ == "__main__":
    print(main(Path(sys.argv[1])))
