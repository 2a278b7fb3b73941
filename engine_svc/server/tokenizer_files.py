"""The model's tokenizer files, read in chunks for GetTokenizer, so a frontend can load the
same tokenizer (and chat template) without access to the model's volume."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

# What Hugging Face tokenizers (fast or slow) and chat templates load from; config.json
# comes along because AutoTokenizer reads the model type from it when tokenizer_config.json
# does not name a class. Weights never do.
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    "config.json",
)
CHUNK_BYTES = 1 << 20  # well under gRPC's default 4 MiB message limit on the client side


def tokenizer_files(model_dir: Path) -> list[Path]:
    return [model_dir / name for name in TOKENIZER_FILE_NAMES if (model_dir / name).is_file()]


def read_chunks(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The file's bytes in order; an empty file gives one empty chunk, so it is still sent."""
    with path.open("rb") as file:
        chunk = file.read(chunk_bytes)
        yield chunk
        while chunk := file.read(chunk_bytes):
            yield chunk
