"""Prefix-cache benchmark: the time to first token of a prompt whose first tokens are in the
engine's prefix cache, against a prompt of the same length with none cached, through the
frontend's gRPC API, one request at a time.

    python -m engine_svc.bench prefix --model DIR [--input-len 1000] [--prefix-len 960]
        [--pairs 8] [--frontend-address HOST:PORT [--engine-address HOST:PORT]]

Each pair sends a fresh prompt of random token ids (nothing of it cached), then a prompt of
the same length that shares its first `--prefix-len` tokens (cached by the first), each to
one new token. Pairs alternate the two kinds, so the machine's drift meets both alike. Prints
each kind's median TTFT, their ratio (the median of the pairs' ratios, with its range), and
the prompt tokens the engine served from its cache (the usage's cached_tokens: the prefix
in whole KV blocks).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from engine_svc.bench import machine
from engine_svc.bench.hardware import DTYPES
from engine_svc.bench.load import vocab_size_of
from engine_svc.bench.serve import request_message, reset_prefix_cache, services
from engine_svc.bench.workload import BenchRequest
from shared.frontend_protos import frontend_pb2_grpc

REQUEST_TIMEOUT_S = 600.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m engine_svc.bench prefix", description=__doc__.splitlines()[0]
    )
    add = parser.add_argument
    add("--model", required=True, help="model directory: the started services', its vocabulary")
    add("--frontend-address", help="a running frontend (else both services are started)")
    add("--engine-address", help="its engine, to empty the prefix cache before each pair")
    add("--engine-arg", action="append", default=[], metavar="ARG",
        help="a flag for the started engine (repeat)")  # fmt: skip
    add("--dtype", choices=sorted(DTYPES), default="float32", help="the started engine's")
    add("--input-len", type=int, default=1000, help="prompt tokens, both kinds")
    add("--prefix-len", type=int, default=960, help="of them, cached in the second")
    add("--pairs", type=int, default=8)
    add("--seed", type=int, default=0)
    add("--start-timeout", type=float, default=600.0)
    add("--result-file", type=Path, help="write every figure as JSON here")
    args = parser.parse_args(argv)
    if not 1 <= args.prefix_len < args.input_len:
        parser.error("need 1 <= --prefix-len < --input-len")
    if args.pairs < 1:
        parser.error("need --pairs >= 1")
    return args


def first_token(
    stub: frontend_pb2_grpc.GenerationServiceStub, prompt: list[int]
) -> tuple[float, int]:
    """Seconds from sending `prompt` (to one new token) to its first token, and the prompt
    tokens the engine served from its cache."""
    request = request_message(BenchRequest(prompt, None, 1))
    began = time.perf_counter()
    ttft, cached = None, 0
    for response in stub.GenerateStream(request, timeout=REQUEST_TIMEOUT_S):
        if ttft is None and any(choice.token_ids for choice in response.choices):
            ttft = time.perf_counter() - began
        if response.HasField("usage"):
            cached = response.usage.cached_tokens
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return ttft, cached


def measure(args: argparse.Namespace, frontend: str, engine: str | None) -> dict[str, Any]:
    vocab_size = vocab_size_of(args.model)
    assert vocab_size is not None
    rng = np.random.default_rng(args.seed)
    uncached, cached, hits = [], [], []
    with grpc.insecure_channel(frontend) as channel:
        stub = frontend_pb2_grpc.GenerationServiceStub(channel)
        first_token(stub, rng.integers(0, vocab_size, size=8).tolist())  # warm-up
        for _ in range(args.pairs):
            reset_prefix_cache(engine)
            fresh = rng.integers(0, vocab_size, size=args.input_len).tolist()
            tail = rng.integers(0, vocab_size, size=args.input_len - args.prefix_len).tolist()
            seconds, _ = first_token(stub, fresh)
            uncached.append(seconds)
            seconds, hit = first_token(stub, fresh[: args.prefix_len] + tail)
            cached.append(seconds)
            hits.append(hit)
    ratios = [c / u for c, u in zip(cached, uncached, strict=True)]
    return {
        "input_len": args.input_len,
        "prefix_len": args.prefix_len,
        "pairs": args.pairs,
        "median_uncached_ttft_ms": 1000 * float(np.median(uncached)),
        "median_cached_ttft_ms": 1000 * float(np.median(cached)),
        "cached_over_uncached": float(np.median(ratios)),
        "cached_over_uncached_min": min(ratios),
        "cached_over_uncached_max": max(ratios),
        "cached_tokens_min": min(hits),
        "cached_tokens_max": max(hits),
    }


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    print(machine.describe(DTYPES[args.dtype]))
    with services(args) as addresses:
        figures = measure(args, addresses.frontend, addresses.engine)
    print(
        f"{args.input_len}-token prompts, one new token, {args.pairs} pairs:\n"
        f"TTFT uncached {figures['median_uncached_ttft_ms']:.1f} ms, with the first "
        f"{args.prefix_len} cached {figures['median_cached_ttft_ms']:.1f} ms (medians)\n"
        f"cached/uncached: {figures['cached_over_uncached']:.3f} (median of the pairs; "
        f"{figures['cached_over_uncached_min']:.3f}-{figures['cached_over_uncached_max']:.3f})"
        f"\nprompt tokens from the prefix cache: {figures['cached_tokens_min']}-"
        f"{figures['cached_tokens_max']} of {args.prefix_len} shared"
    )
    if args.result_file is not None:
        result = {"mode": "prefix", **machine.identity(), "dtype": args.dtype, **figures}
        args.result_file.write_text(json.dumps(result, indent=2))
        print(f"results: {args.result_file}")
    if figures["cached_tokens_min"] == 0:
        sys.exit("a second prompt found nothing in the prefix cache: is prefix caching off?")
