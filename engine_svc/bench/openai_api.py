"""OpenAI-compatible benchmark: the serving workloads and figures through any server's
streaming `/v1/completions` (smg in front of our engine, vLLM's own server), so that two
engines run one workload, measured by one client.

    python -m engine_svc.bench openai --base-url http://127.0.0.1:30000 --model DIR
        [--served-model-name NAME] [--engine-address HOST:PORT] [load options]

Prompts go as text (random and shared-prefix prompts decoded with the model's tokenizer, as
every OpenAI server takes text; `--prompt-ids` sends the ids to servers that take arrays,
such as vLLM's), with `max_tokens`, `ignore_eos` (vLLM's extension) and
`stream_options.include_usage`: token counts are the server's; each chunk with choices is
timed as it arrives (its text may be empty).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from engine_svc.bench import hardware, load
from engine_svc.bench.metrics import RequestRecord
from engine_svc.bench.serve import reset_prefix_cache
from engine_svc.bench.workload import BenchRequest
from shared.errors import InvalidRequestError

READ_TIMEOUT_S = 600.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m engine_svc.bench openai", description=__doc__.splitlines()[0]
    )
    add = parser.add_argument
    add("--base-url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    add("--model", help="the model's directory: its vocabulary, and MFU/MBU's parameters")
    add("--served-model-name", help="the `model` field to send (default: the server's first)")
    add("--engine-address", help="our engine behind it, to empty the prefix cache between runs")
    add("--dtype", choices=sorted(hardware.DTYPES), default="float32", help="the ceilings' dtype")
    add("--skip-ceilings", action="store_true", help="no GEMM and copy ceilings (MFU, MBU)")
    add("--prompt-ids", action="store_true", help="send token ids, not their text")
    load.add_load_arguments(parser)
    args = parser.parse_args(argv)
    load.check_load_arguments(parser, args)
    args.base_url = args.base_url.rstrip("/")
    return args


class OpenAIClient:
    """Streams `/v1/completions` over one aiohttp session of `max_in_flight` connections."""

    def __init__(self, base_url: str, model_name: str, max_in_flight: int) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._url = f"{base_url}/v1/completions"
        self._model_name = model_name
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max_in_flight),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=READ_TIMEOUT_S),
        )

    async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
        payload = {
            "model": self._model_name,
            "prompt": request.prompt_token_ids if request.prompt is None else request.prompt,
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            async with self._session.post(self._url, json=payload) as response:
                if response.status != 200:
                    body = (await response.text())[:300]
                    raise load.StreamError(f"HTTP {response.status}: {body}")
                async for line in response.content:
                    if _take(line, record):
                        break
        except self._aiohttp.ClientError as error:
            raise load.StreamError(f"{type(error).__name__}: {error}") from error
        if record.chunk_times and not record.output_tokens:
            record.output_tokens = len(record.chunk_times)  # a server that sends no usage

    async def close(self) -> None:
        await self._session.close()


def _take(line: bytes, record: RequestRecord) -> bool:
    """One server-sent-events line into the record; True at the stream's end."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return False
    data = line[len(b"data:") :].strip()
    if data == b"[DONE]":
        return True
    chunk: dict[str, Any] = json.loads(data)
    if "error" in chunk:
        raise load.StreamError(f"error event: {chunk['error']}")
    if chunk.get("choices"):  # timed even when its text is empty (a special token), as vLLM
        record.chunk_times.append(time.perf_counter())
    usage = chunk.get("usage")
    if usage:
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = int(details.get("cached_tokens") or 0)
    return False


def as_text(requests: list[BenchRequest], model: str) -> list[BenchRequest]:
    """Token-id prompts decoded with the model's tokenizer (the server re-tokenizes them:
    its prompt token counts are what the figures use)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    return [
        request if request.prompt_token_ids is None else
        BenchRequest(None, tokenizer.decode(request.prompt_token_ids), request.output_len)
        for request in requests
    ]  # fmt: skip


def served_model_name(base_url: str) -> str:
    """The first model the server lists at /v1/models."""
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as response:
        models = json.loads(response.read())["data"]
    if not models:
        raise InvalidRequestError("served_model_name", f"{base_url}/v1/models lists none")
    return str(models[0]["id"])


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    try:
        requests = load.make_requests(args, load.vocab_size_of(args.model))
        if not args.prompt_ids and args.model is not None:
            requests = as_text(requests, args.model)
        name = args.served_model_name or served_model_name(args.base_url)
    except (InvalidRequestError, OSError) as error:
        sys.exit(f"bench openai: {error}")
    ceilings = load.measure_ceilings(args)
    print(f"server: {args.base_url}, model {name}")
    runs = load.sweep(
        args,
        requests,
        lambda in_flight: OpenAIClient(args.base_url, name, in_flight),
        lambda: reset_prefix_cache(args.engine_address),
        ceilings,
    )
    load.finish(args, {"mode": "openai", "base_url": args.base_url, "served_model_name": name,
                  "num_prompts": len(requests)}, runs)  # fmt: skip
