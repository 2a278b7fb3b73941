"""Drive an LLM's in-process client step by step, and check the KV cache is left clean."""

from __future__ import annotations

import itertools

from engine_svc import LLM, SamplingParams
from engine_svc.executor.uniproc import UniProcExecutor
from engine_svc.messages import EngineCoreRequest


def generate_staggered(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], arrival_steps: list[int]
) -> list[list[int]]:
    """Add each request at its own step of the engine, then run until all finish."""
    client = llm.client
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finished: set[str] = set()
    for step in itertools.count():
        assert step < 10_000, "engine did not finish"
        for i, arrival in enumerate(arrival_steps):
            if arrival == step:
                client.add_request(
                    EngineCoreRequest(
                        request_id=str(i), prompt_token_ids=prompts[i], sampling_params=params[i]
                    )
                )
        for output in client.get_output().outputs:
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finished:
                finished.add(output.request_id)
        if len(finished) == len(prompts):
            return [tokens[str(i)] for i in range(len(prompts))]
    raise AssertionError("unreachable")


def assert_kv_cache_clean(llm: LLM) -> None:
    core = llm.engine_core
    pool = core.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks, "KV blocks leaked"
    assert not core.scheduler.has_requests()
    executor = core.executor
    assert isinstance(executor, UniProcExecutor)
    assert not executor.runner.states, "model runner kept request state"
