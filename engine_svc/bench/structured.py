"""Structured output's cost per engine step: 32 JSON-schema requests against 32 free ones.

The grammar bitmask is filled while the forward runs, so steps per second should barely
move (issue target: at least 90% of the unconstrained figure). Medians over alternating rounds.
"""

from __future__ import annotations

import json
import statistics
import time

from engine_svc import LLM, SamplingParams
from engine_svc.messages import EngineCoreRequest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "notes": {"type": "string"},
    },
    "required": ["name", "age", "color", "notes"],
}


def steps_per_second(llm: LLM, params: SamplingParams, num_requests: int, max_steps: int) -> float:
    """Run `num_requests` copies of one chat prompt; engine steps per second over the steps
    that ran the whole batch (constrained requests finish early: a smaller batch would
    flatter them)."""
    messages = [{"role": "user", "content": "Describe a person as JSON, with long notes."}]
    text = str(
        llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )
    prompt = llm.tokenizer.encode(text)
    client = llm.client
    ids = [f"bench-{i}" for i in range(num_requests)]
    for request_id in ids:
        client.add_request(
            EngineCoreRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling_params=params
            )
        )
    finished: set[str] = set()
    full_batch_steps, full_batch_s = 0, 0.0
    running = 0
    for _ in range(max_steps):
        started = time.perf_counter()
        outputs = client.get_output()
        step_s = time.perf_counter() - started
        if running == num_requests:  # this step ran with the whole batch
            full_batch_steps += 1
            full_batch_s += step_s
        finished.update(o.request_id for o in outputs.outputs if o.finished)
        stats = outputs.scheduler_stats
        running = stats.num_running_reqs if stats is not None else 0
        if len(finished) == num_requests:
            break
    client.abort_requests([i for i in ids if i not in finished])
    while client.has_unfinished_requests():
        client.get_output()
    return full_batch_steps / full_batch_s if full_batch_steps else 0.0


def compare(
    llm: LLM, num_requests: int = 32, max_steps: int = 48, rounds: int = 3
) -> dict[str, float]:
    """Free and constrained runs alternate for `rounds` rounds; each figure is its median,
    so that a burst of noise on a shared machine moves one run, not the ratio."""
    schema = json.dumps(SCHEMA)
    free = SamplingParams(temperature=1.0, seed=0, max_tokens=max_steps + 8, ignore_eos=True)
    constrained = SamplingParams(
        temperature=1.0, seed=0, max_tokens=max_steps + 8, json_schema=schema
    )
    llm.generate(["warm up"], constrained)  # compile the grammar outside the timing
    free_rates, json_rates = [], []
    for _ in range(rounds):
        free_rates.append(steps_per_second(llm, free, num_requests, max_steps))
        json_rates.append(steps_per_second(llm, constrained, num_requests, max_steps))
    free_rate, json_rate = statistics.median(free_rates), statistics.median(json_rates)
    return {
        "steps_per_s_free": free_rate,
        "steps_per_s_json": json_rate,
        "json_over_free": json_rate / free_rate if free_rate else 0.0,
    }
