"""Scheduler: a mixed random workload under memory pressure gives exactly the expected
outputs, with a fake runner (scheduler_harness.py)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from engine_svc.core.request import Request
from engine_svc.messages import FinishReason
from tests.engine_svc.scheduler_harness import (
    VOCAB_SIZE,
    FakeEngine,
    expected_tokens,
    make_request,
)

# ---- a mixed workload -------------------------------------------------------------------


def random_workload(seed: int) -> list[tuple[int, Request]]:
    """(step at which it arrives, request): prompts share prefixes, some arrive late."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB_SIZE) for _ in range(8)] for _ in range(3)]
    workload = []
    for n in range(14):
        prompt = rng.choice(prefixes)[: rng.randint(0, 8)]
        prompt += [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 12))]
        request = make_request(
            f"r{n}",
            prompt,
            priority=rng.randrange(3),
            arrival_time=float(n),
            max_tokens=rng.randint(1, 16),
        )
        workload.append((rng.choice([0, 0, 3, 6, 10]), request))
    return workload


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize(
    ("enable_chunked_prefill", "max_num_batched_tokens"), [(True, 12), (False, 40)]
)
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_a_mixed_workload_under_memory_pressure_gives_the_expected_outputs(
    make_engine: Callable[..., FakeEngine],
    seed: int,
    policy: str,
    enable_chunked_prefill: bool,
    max_num_batched_tokens: int,
    enable_prefix_caching: bool,
) -> None:
    engine = make_engine(
        max_model_len=40,
        num_kv_blocks=10,
        max_num_seqs=4,
        policy=policy,
        enable_chunked_prefill=enable_chunked_prefill,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
    )
    workload = random_workload(seed)

    for step in range(1000):
        engine.add(*(request for arrival, request in workload if arrival == step))
        if step > max(arrival for arrival, _ in workload) and not engine.scheduler.has_requests():
            break
        engine.step()

    assert engine.scheduler.num_preemptions > 0
    for _, request in workload:
        result = engine.results[request.request_id]
        num_tokens = request.sampling_params.max_tokens or 0
        assert result.token_ids == expected_tokens(request.prompt_token_ids, num_tokens)
        assert result.finish_reason == FinishReason.LENGTH
