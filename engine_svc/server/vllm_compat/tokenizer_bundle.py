"""The model's tokenizer files as one zip archive in chunks, the form VllmEngine's
GetTokenizer sends them in (the SHA-256 of the whole archive on the last chunk), so a gateway
without the model's volume can tokenize and render chat templates."""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

from engine_svc.server.tokenizer_files import tokenizer_files

# Small chunks: gateways' gRPC clients keep their default 4 MiB limit on received messages.
CHUNK_BYTES = 64 << 10


def build_archive(model_dir: Path) -> bytes:
    """A flat zip of the tokenizer files (the same files engine.v1's GetTokenizer sends)."""
    files = tokenizer_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no tokenizer files in {model_dir}")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            archive.write(path, path.name)
    return buffer.getvalue()


def archive_chunks(archive: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[bytes, str]]:
    """(data, sha256) pairs: the digest on the last chunk only, empty before it."""
    digest = hashlib.sha256(archive).hexdigest()
    for start in range(0, len(archive), chunk_bytes):
        end = start + chunk_bytes
        yield archive[start:end], digest if end >= len(archive) else ""
