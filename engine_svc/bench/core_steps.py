"""The engine core's own CPU time per step at a given number of running requests: the
core in this process with the null executor (no model, no IPC, no gRPC), stepped by hand
once every request runs, so the figure is scheduling and output processing alone."""

from __future__ import annotations

import time

import numpy as np

from engine_svc.messages import EngineCoreRequest
from engine_svc.sampling_params import SamplingParams

WARMUP_STEP_LIMIT = 100  # steps to admit every request (their prefills) before measuring
ROUNDS = 3
BLOCK_SIZE = 16  # the engine's default


def cpu_ms_per_step(model: str, running: int, steps: int = 200, input_len: int = 32) -> float:
    """CPU milliseconds a step with `running` decoding requests (best of ROUNDS runs of
    `steps`), as this process's CPU time (the null executor runs on this thread, and
    nothing else runs meanwhile)."""
    from engine_svc import LLM

    # Long enough that none finishes while measured, with blocks for all: none is preempted.
    max_tokens = WARMUP_STEP_LIMIT + ROUNDS * steps
    blocks_each = -(-(input_len + max_tokens) // BLOCK_SIZE) + 1
    llm = LLM(
        model,
        null_executor=True,
        max_num_seqs=running,
        block_size=BLOCK_SIZE,
        num_kv_blocks=running * blocks_each,
    )
    try:
        client = llm.client
        scheduler = llm.engine_core.scheduler
        rng = np.random.default_rng(0)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        high = max(client.limits.vocab_size - 1, 101)
        for index in range(running):
            prompt = rng.integers(100, high, size=input_len).tolist()
            client.add_request(
                EngineCoreRequest(request_id=str(index), prompt_token_ids=prompt,
                                  sampling_params=params)
            )  # fmt: skip
        for _ in range(WARMUP_STEP_LIMIT):
            client.get_output()
            if len(scheduler.running) == running and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running
            ):
                break
        else:
            raise RuntimeError(f"{running} requests did not all start within the warm-up")
        best = float("inf")
        for _ in range(ROUNDS):
            began = time.process_time()
            for _ in range(steps):
                client.get_output()
            best = min(best, (time.process_time() - began) / steps)
        if len(scheduler.running) != running:
            raise RuntimeError("a request finished or was preempted while measured")
        return best * 1000
    finally:
        llm.shutdown()
