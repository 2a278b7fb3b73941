"""The engine service's vLLM metrics, fed by the asyncio client as its observer: the
scheduler's gauges and counters per data-parallel rank (label engine), from the stats on every
batch of outputs, and the per-request histograms this process can measure (time to first
token from the Generate call, inter-token latency and the queue/prefill/decode phases from the
engine core's own clock)."""

from __future__ import annotations

import dataclasses
import time

from prometheus_client import CollectorRegistry

from engine_svc.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestTimes,
    SchedulerStats,
)
from shared.metrics import catalog
from shared.metrics.requests import FinishedRequest, RequestMetrics


class EngineStatsMetrics:
    """vLLM's scheduler metrics, one series per rank from the start (zero until it reports)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, num_ranks: int) -> None:
        self.model_name = model_name
        self._running = catalog.NUM_REQUESTS_RUNNING.gauge(registry)
        self._waiting = catalog.NUM_REQUESTS_WAITING.gauge(registry)
        self._kv_cache_usage = catalog.KV_CACHE_USAGE.gauge(registry)
        self._prefix_queries = catalog.PREFIX_CACHE_QUERIES.counter(registry)
        self._prefix_hits = catalog.PREFIX_CACHE_HITS.counter(registry)
        self._preemptions = catalog.NUM_PREEMPTIONS.counter(registry)
        self._prompt_tokens = catalog.PROMPT_TOKENS.counter(registry)
        self._generation_tokens = catalog.GENERATION_TOKENS.counter(registry)
        self._iteration_tokens = catalog.ITERATION_TOKENS.histogram(registry)
        self._batches_in_flight = catalog.NUM_BATCHES_IN_FLIGHT.gauge(registry)
        self._last: dict[int, SchedulerStats] = {}
        for rank in range(num_ranks):
            self.record(rank, SchedulerStats())

    def record(self, rank: int, stats: SchedulerStats) -> None:
        labels = (self.model_name, str(rank))
        self._running.labels(*labels).set(stats.num_running_reqs)
        self._waiting.labels(*labels).set(stats.num_waiting_reqs)
        self._kv_cache_usage.labels(*labels).set(stats.kv_cache_usage)
        self._batches_in_flight.labels(*labels).set(stats.num_batches_in_flight)
        # The engine's prefix-cache and preemption counts are cumulative: export the growth.
        last = self._last.get(rank, SchedulerStats())
        self._last[rank] = stats
        cumulative = (
            (self._prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
            (self._prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
            (self._preemptions, stats.num_preemptions, last.num_preemptions),
        )
        for counter, now, before in cumulative:
            counter.labels(*labels).inc(now - before if now >= before else now)
        self._prompt_tokens.labels(*labels).inc(stats.num_prompt_tokens)
        self._generation_tokens.labels(*labels).inc(stats.num_generation_tokens)
        num_step_tokens = stats.num_prompt_tokens + stats.num_generation_tokens
        if num_step_tokens:
            self._iteration_tokens.labels(*labels).observe(num_step_tokens)


@dataclasses.dataclass
class _RequestState:
    engine: str
    arrival_time: float  # this process's time.monotonic()
    num_prompt_tokens: int
    num_generation_tokens: int = 0
    times: RequestTimes | None = None
    first_token_ts: float | None = None  # the engine core's clock from here on
    last_token_ts: float | None = None


class EngineServiceMetrics:
    """The client's RequestObserver. `request_metrics=False` leaves the client's view of a
    request (time to first token, inter-token latency, end-to-end latency, lengths, finished
    requests) to the frontend, and exports only the phases that only the engine sees."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        num_ranks: int,
        max_model_len: int,
        request_metrics: bool = True,
    ) -> None:
        self.engine_stats = EngineStatsMetrics(registry, model_name, num_ranks)
        self.requests = RequestMetrics(registry, model_name, max_model_len)
        self.request_metrics = request_metrics
        self._states: dict[str, _RequestState] = {}

    def on_request_added(self, request: EngineCoreRequest, rank: int) -> None:
        self._states[request.request_id] = _RequestState(
            engine=str(rank),
            arrival_time=request.arrival_time or time.monotonic(),
            num_prompt_tokens=len(request.prompt_token_ids),
        )

    def on_outputs(self, rank: int, outputs: EngineCoreOutputs) -> None:
        if outputs.scheduler_stats is not None:
            self.engine_stats.record(rank, outputs.scheduler_stats)
        for output in outputs.outputs:
            state = self._states.get(output.request_id)
            if state is not None:
                self._on_output(state, output, outputs.timestamp)

    def on_request_gone(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _on_output(self, state: _RequestState, output: EngineCoreOutput, timestamp: float) -> None:
        if output.times is not None:
            state.times = output.times
        if output.new_token_ids:
            if state.last_token_ts is None:
                state.first_token_ts = timestamp
                if self.request_metrics:
                    ttft = time.monotonic() - state.arrival_time
                    self.requests.observe_first_token(state.engine, ttft)
            elif self.request_metrics:
                self.requests.observe_inter_token(state.engine, timestamp - state.last_token_ts)
            state.last_token_ts = timestamp
            state.num_generation_tokens += len(output.new_token_ids)
        if output.finish_reason is not None:
            self._states.pop(output.request_id, None)
            self._on_finished(state, str(output.finish_reason))

    def _on_finished(self, state: _RequestState, finish_reason: str) -> None:
        times, first, last = state.times, state.first_token_ts, state.last_token_ts
        queue = None if times is None else times.scheduled - times.queued
        prefill = None if times is None or first is None else first - times.scheduled
        decode = None if first is None or last is None else last - first
        if not self.request_metrics:
            self.requests.observe_phases(state.engine, queue, prefill, decode)
            return
        finished = FinishedRequest(
            finish_reason=finish_reason,
            num_prompt_tokens=state.num_prompt_tokens,
            num_generation_tokens=state.num_generation_tokens,
            e2e_latency_s=time.monotonic() - state.arrival_time,
            queue_time_s=queue,
            prefill_time_s=prefill,
            decode_time_s=decode,
        )
        self.requests.observe_finished(state.engine, finished)
