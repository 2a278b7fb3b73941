"""The tokenizer from an engine's GetTokenizer, for frontends without the model's volume: the
files go into a private temporary directory, are loaded from there, and are deleted."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from frontend_svc.tokenizer import Tokenizer
from shared.protos import engine_pb2, engine_pb2_grpc

MAX_TOKENIZER_BYTES = 512 << 20


async def fetch_tokenizer(
    stub: engine_pb2_grpc.EngineCoreServiceStub, timeout_s: float
) -> Tokenizer:
    # mkdtemp makes the directory readable by this user only.
    with tempfile.TemporaryDirectory(prefix="duoserve-tokenizer-") as directory:
        await download_tokenizer_files(stub, Path(directory), timeout_s)
        # Loading parses megabytes of JSON: off the event loop, which serves health checks.
        return await asyncio.to_thread(Tokenizer.load, Path(directory))


async def download_tokenizer_files(
    stub: engine_pb2_grpc.EngineCoreServiceStub, directory: Path, timeout_s: float
) -> dict[str, int]:
    """Writes the streamed files into `directory`; returns their sizes by name."""
    sizes: dict[str, int] = {}
    total = 0
    async for chunk in stub.GetTokenizer(engine_pb2.GetTokenizerRequest(), timeout=timeout_s):
        name = _checked_name(chunk.file_name)
        total += len(chunk.data)
        if total > MAX_TOKENIZER_BYTES:
            raise ValueError(f"the engine's tokenizer files exceed {MAX_TOKENIZER_BYTES} bytes")
        with (directory / name).open("ab") as file:
            file.write(chunk.data)
        sizes[name] = chunk.file_size
    for name, size in sizes.items():
        if (directory / name).stat().st_size != size:
            raise ValueError(f"tokenizer file {name} arrived incomplete")
    if not sizes:
        raise ValueError("the engine sent no tokenizer files")
    return sizes


def _checked_name(name: str) -> str:
    # A file name, never a path: the engine must not write outside the directory.
    if not name or name != Path(name).name or name.startswith("."):
        raise ValueError(f"bad tokenizer file name from the engine: {name!r}")
    return name
