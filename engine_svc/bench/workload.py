"""What a serving benchmark sends, and when (`python -m engine_svc.bench serve`).

Prompts: seeded random token ids of given lengths, a JSON-lines file of prompts, or groups
of requests that share a long system prompt (prefix caching). Arrivals: all at once, a
Poisson process at a request rate, or a gamma process of the same mean rate whose
`burstiness` below 1 clusters requests (vLLM's `bench serve` definitions). Lengths are exact:
requests ask for `ignore_eos`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from shared.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int] | None  # token ids, or
    prompt: str | None  # text for the frontend to tokenize
    output_len: int


def random_requests(
    num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int
) -> list[BenchRequest]:
    """`num` prompts of random token ids, their lengths uniform in
    [input_len * (1 - r), input_len * (1 + r)], each to exactly `output_len` new tokens."""
    _check(0.0 <= range_ratio < 1.0, "range_ratio", "must be in [0, 1)")
    _check(output_len >= 1, "output_len", "must be >= 1")
    rng = np.random.default_rng(seed)
    inputs = _lengths(rng, num, input_len, range_ratio)
    return [
        BenchRequest(rng.integers(0, vocab_size, size=int(n)).tolist(), None, output_len)
        for n in inputs
    ]


def shared_prefix_requests(
    num_groups: int,
    per_group: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """`num_groups` system prompts of `prefix_len` tokens, each followed by `per_group`
    different questions of `suffix_len` tokens: what prefix caching serves. Groups are
    interleaved, as clients of several applications would send them."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab_size, size=prefix_len).tolist() for _ in range(num_groups)]
    return [
        BenchRequest(prefixes[g] + rng.integers(0, vocab_size, size=suffix_len).tolist(), None,
                     output_len)
        for _ in range(per_group)
        for g in range(num_groups)
    ]  # fmt: skip


def jsonl_requests(path: Path, output_len: int, limit: int | None) -> list[BenchRequest]:
    """One JSON object a line: `prompt` (text) or `prompt_token_ids`, and optionally
    `output_len` (else the flag's)."""
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise InvalidRequestError("dataset", f"{path}:{number}: {error}") from error
        ids, text = record.get("prompt_token_ids"), record.get("prompt")
        if (ids is None) == (text is None):
            raise InvalidRequestError(
                "dataset", f"{path}:{number}: give one of prompt or prompt_token_ids"
            )
        requests.append(BenchRequest(ids, text, int(record.get("output_len", output_len))))
        if limit is not None and len(requests) == limit:
            break
    if not requests:
        raise InvalidRequestError("dataset", f"{path}: no prompts")
    return requests


def arrival_gaps(num: int, request_rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Seconds to wait before each request: 0 at an infinite rate, else gamma-distributed
    with mean 1 / request_rate (shape `burstiness`: 1 is a Poisson process)."""
    _check(request_rate > 0, "request_rate", "must be > 0 (inf: all at once)")
    _check(burstiness > 0, "burstiness", "must be > 0")
    rng = np.random.default_rng(seed)
    for _ in range(num):
        if math.isinf(request_rate):
            yield 0.0
        else:
            yield float(rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness)))


def _lengths(rng: np.random.Generator, num: int, length: int, ratio: float) -> np.ndarray:
    _check(length >= 1, "input_len", "must be >= 1")
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.integers(low, high, size=num, endpoint=True)


def _check(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise InvalidRequestError(field, message)
