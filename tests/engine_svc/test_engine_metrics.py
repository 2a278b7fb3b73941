"""The engine service's metrics from what the engine core sends: per-rank scheduler gauges and
counters, and per-request latencies and phases from the engine core's timestamps. Also the
scheduler's side: queue and schedule times ride on a request's first token only."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from engine_svc.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    RequestTimes,
    SchedulerStats,
)
from engine_svc.sampling_params import SamplingParams
from engine_svc.server.metrics import EngineServiceMetrics
from tests.engine_svc.scheduler_harness import FakeEngine, make_config, make_request

MODEL = "tiny"


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"model_name": MODEL, **labels})
    return 0.0 if value is None else value


def _metrics(request_metrics: bool = True) -> tuple[EngineServiceMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = EngineServiceMetrics(registry, MODEL, 2, 1024, request_metrics=request_metrics)
    return metrics, registry


def _request(request_id: str, num_prompt_tokens: int, arrival_time: float) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(range(3, 3 + num_prompt_tokens)),
        sampling_params=SamplingParams(max_tokens=3),
        arrival_time=arrival_time,
    )


def _token(
    request_id: str,
    finish_reason: FinishReason | None = None,
    times: RequestTimes | None = None,
) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=request_id, new_token_ids=[7], finish_reason=finish_reason, times=times
    )


def test_scheduler_stats_become_per_rank_gauges_and_counters() -> None:
    metrics, registry = _metrics()
    assert _value(registry, "vllm:num_requests_running", engine="1") == 0  # exists from start
    stats = SchedulerStats(
        num_running_reqs=3,
        num_waiting_reqs=2,
        kv_cache_usage=0.25,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
        num_preemptions=1,
        num_prompt_tokens=60,
        num_generation_tokens=3,
    )
    metrics.on_outputs(1, EngineCoreOutputs(scheduler_stats=stats))
    later = SchedulerStats(
        num_running_reqs=1,
        kv_cache_usage=0.5,
        prefix_cache_queries=130,
        prefix_cache_hits=40,
        num_preemptions=1,
        num_generation_tokens=1,
    )
    metrics.on_outputs(1, EngineCoreOutputs(scheduler_stats=later))
    metrics.on_outputs(1, EngineCoreOutputs(scheduler_stats=SchedulerStats()))  # idle: no step
    one = {"engine": "1"}
    assert _value(registry, "vllm:num_requests_running", **one) == 0
    assert _value(registry, "vllm:kv_cache_usage_perc", **one) == 0
    # Cumulative counts from the engine are exported as counters, never counted twice.
    assert _value(registry, "vllm:prefix_cache_queries_total", **one) == 130
    assert _value(registry, "vllm:prefix_cache_hits_total", **one) == 40
    assert _value(registry, "vllm:num_preemptions_total", **one) == 1
    assert _value(registry, "vllm:prompt_tokens_total", **one) == 60
    assert _value(registry, "vllm:generation_tokens_total", **one) == 4
    assert _value(registry, "vllm:iteration_tokens_total_count", **one) == 2
    assert _value(registry, "vllm:iteration_tokens_total_sum", **one) == 64
    assert _value(registry, "vllm:generation_tokens_total", engine="0") == 0


def test_request_latencies_and_phases_come_from_the_engine_clock() -> None:
    metrics, registry = _metrics()
    metrics.on_request_added(_request("a", 12, arrival_time=1.0), rank=1)
    times = RequestTimes(queued=100.0, scheduled=100.5)
    metrics.on_outputs(1, EngineCoreOutputs(outputs=[_token("a", times=times)], timestamp=101.0))
    metrics.on_outputs(1, EngineCoreOutputs(outputs=[_token("a")], timestamp=101.25))
    last = _token("a", FinishReason.LENGTH)
    metrics.on_outputs(1, EngineCoreOutputs(outputs=[last], timestamp=102.0))
    one = {"engine": "1"}
    assert _value(registry, "vllm:request_success_total", finished_reason="length", **one) == 1
    assert _value(registry, "vllm:time_to_first_token_seconds_count", **one) == 1
    assert _value(registry, "vllm:inter_token_latency_seconds_count", **one) == 2
    assert _value(registry, "vllm:inter_token_latency_seconds_sum", **one) == pytest.approx(1.0)
    assert _value(registry, "vllm:request_queue_time_seconds_sum", **one) == pytest.approx(0.5)
    assert _value(registry, "vllm:request_prefill_time_seconds_sum", **one) == pytest.approx(0.5)
    assert _value(registry, "vllm:request_decode_time_seconds_sum", **one) == pytest.approx(1.0)
    assert _value(registry, "vllm:request_prompt_tokens_sum", **one) == 12
    assert _value(registry, "vllm:request_generation_tokens_sum", **one) == 3
    assert _value(registry, "vllm:e2e_request_latency_seconds_count", **one) == 1


def test_without_request_metrics_only_the_engine_phases_are_exported() -> None:
    metrics, registry = _metrics(request_metrics=False)
    metrics.on_request_added(_request("a", 4, arrival_time=1.0), rank=0)
    times = RequestTimes(queued=10.0, scheduled=10.25)
    metrics.on_outputs(0, EngineCoreOutputs(outputs=[_token("a", times=times)], timestamp=11.0))
    done = _token("a", FinishReason.STOP)
    metrics.on_outputs(0, EngineCoreOutputs(outputs=[done], timestamp=11.5))
    zero = {"engine": "0"}
    assert _value(registry, "vllm:request_queue_time_seconds_sum", **zero) == pytest.approx(0.25)
    assert _value(registry, "vllm:request_decode_time_seconds_sum", **zero) == pytest.approx(0.5)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert (
            registry.get_sample_value(f"vllm:{name}_count", {"model_name": MODEL, **zero}) is None
        )
    assert _value(registry, "vllm:request_success_total", finished_reason="stop", **zero) == 0


def test_a_request_aborted_while_waiting_counts_as_abort_without_phases() -> None:
    metrics, registry = _metrics()
    metrics.on_request_added(_request("a", 4, arrival_time=1.0), rank=0)
    aborted = EngineCoreOutput(request_id="a", new_token_ids=[], finish_reason=FinishReason.ABORT)
    metrics.on_outputs(0, EngineCoreOutputs(outputs=[aborted], timestamp=5.0))
    zero = {"engine": "0"}
    assert _value(registry, "vllm:request_success_total", finished_reason="abort", **zero) == 1
    assert _value(registry, "vllm:request_queue_time_seconds_count", **zero) == 0
    assert _value(registry, "vllm:time_to_first_token_seconds_count", **zero) == 0
    # A request the client dropped (engine died) leaves nothing behind and records nothing.
    metrics.on_request_added(_request("b", 4, arrival_time=1.0), rank=0)
    metrics.on_request_gone("b")
    metrics.on_outputs(0, EngineCoreOutputs(outputs=[_token("b", FinishReason.STOP)]))
    assert _value(registry, "vllm:request_success_total", finished_reason="stop", **zero) == 0


def test_the_scheduler_sends_queue_and_schedule_times_with_the_first_token_only() -> None:
    # One request at a time: the second waits in the queue while the first runs.
    engine = FakeEngine(make_config(max_num_seqs=1))
    engine.add(make_request("a", [1, 2, 3], max_tokens=3), make_request("b", [4, 5], max_tokens=2))
    outputs: dict[str, list[EngineCoreOutput]] = {"a": [], "b": []}
    for _ in range(20):
        if not engine.scheduler.has_requests():
            break
        for output in engine.step():
            outputs[output.request_id].append(output)
    first_a, first_b = outputs["a"][0].times, outputs["b"][0].times
    assert first_a is not None and first_b is not None
    assert all(output.times is None for output in outputs["a"][1:] + outputs["b"][1:])
    assert first_a.queued <= first_a.scheduled <= first_b.scheduled
    assert first_b.scheduled - first_b.queued >= first_a.scheduled - first_a.queued


def test_prompt_tokens_of_a_chunked_prefill_are_all_counted() -> None:
    engine = FakeEngine(make_config(max_num_batched_tokens=8, max_model_len=64))
    engine.add(make_request("long", list(range(1, 30)), max_tokens=2))
    num_prompt_tokens = 0
    for _ in range(20):
        if not engine.scheduler.has_requests():
            break
        engine.step()
        num_prompt_tokens += engine.scheduler.make_stats().num_prompt_tokens
    assert num_prompt_tokens == 29
