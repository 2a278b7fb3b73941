"""vLLM's per-request metrics (time to first token, inter-token latency, end-to-end latency,
queue/prefill/decode phases, prompt and generation lengths, finished requests by reason),
recorded from timings a service measures itself.

Per request, as frontend_svc/metrics.py does (clock: time.monotonic()):

    timer = request_metrics.start_request(engine="", num_prompt_tokens=12)
    for update in updates:
        timer.on_tokens(num_new_tokens)  # 0 is fine: no gap is recorded
    timer.finish("stop")  # or "length", "abort", "error"; nothing is recorded without it
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram

from shared.metrics import catalog

Clock = Callable[[], float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinishedRequest:
    """One request's totals. Phases are None where the recorder cannot see them (the queue,
    prefill and decode phases are only visible inside the engine)."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency_s: float | None = None
    queue_time_s: float | None = None
    prefill_time_s: float | None = None
    decode_time_s: float | None = None


PHASES = (catalog.REQUEST_QUEUE_TIME, catalog.REQUEST_PREFILL_TIME, catalog.REQUEST_DECODE_TIME)


class RequestMetrics:
    """The per-request metrics of one service, in its registry, for one served model. With
    `phases` False (a recorder outside the engines, which cannot see them) the queue,
    prefill and decode histograms are not exported at all, rather than exported empty."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        max_model_len: int,
        phases: bool = True,
    ) -> None:
        self.model_name = model_name
        self._success = catalog.REQUEST_SUCCESS.counter(registry)
        histograms = {
            spec.name: spec.histogram(registry, max_model_len)
            for spec in catalog.REQUEST_METRICS
            if spec.kind == catalog.Kind.HISTOGRAM and (phases or spec not in PHASES)
        }
        self._ttft = histograms[catalog.TIME_TO_FIRST_TOKEN.name]
        self._itl = histograms[catalog.INTER_TOKEN_LATENCY.name]
        self._e2e = histograms[catalog.E2E_REQUEST_LATENCY.name]
        self._queue = histograms.get(catalog.REQUEST_QUEUE_TIME.name)
        self._prefill = histograms.get(catalog.REQUEST_PREFILL_TIME.name)
        self._decode = histograms.get(catalog.REQUEST_DECODE_TIME.name)
        self._prompt_tokens = histograms[catalog.REQUEST_PROMPT_TOKENS.name]
        self._generation_tokens = histograms[catalog.REQUEST_GENERATION_TOKENS.name]

    def observe_first_token(self, engine: str, seconds: float) -> None:
        self._ttft.labels(self.model_name, engine).observe(seconds)

    def observe_inter_token(self, engine: str, seconds: float) -> None:
        self._itl.labels(self.model_name, engine).observe(seconds)

    def observe_finished(self, engine: str, request: FinishedRequest) -> None:
        labels = (self.model_name, engine)
        self._success.labels(*labels, request.finish_reason).inc()
        self._prompt_tokens.labels(*labels).observe(request.num_prompt_tokens)
        self._generation_tokens.labels(*labels).observe(request.num_generation_tokens)
        self._observe(self._e2e, engine, request.e2e_latency_s)
        self.observe_phases(
            engine, request.queue_time_s, request.prefill_time_s, request.decode_time_s
        )

    def observe_phases(
        self,
        engine: str,
        queue_time_s: float | None,
        prefill_time_s: float | None,
        decode_time_s: float | None,
    ) -> None:
        """The phases a finished request went through (None: it never reached that one)."""
        self._observe(self._queue, engine, queue_time_s)
        self._observe(self._prefill, engine, prefill_time_s)
        self._observe(self._decode, engine, decode_time_s)

    def _observe(self, histogram: Histogram | None, engine: str, seconds: float | None) -> None:
        if seconds is None:
            return
        if histogram is None:
            raise ValueError("these request metrics were made without the phases")
        histogram.labels(self.model_name, engine).observe(max(seconds, 0.0))

    def start_request(
        self, engine: str, num_prompt_tokens: int, clock: Clock = time.monotonic
    ) -> RequestTimer:
        """A timer for one request that starts now (see the module's docstring)."""
        return RequestTimer(self, engine, num_prompt_tokens, clock)


class RequestTimer:
    """Times one request as its caller sees it: the first token, the gap before each later
    batch of tokens, and the whole request."""

    def __init__(
        self, metrics: RequestMetrics, engine: str, num_prompt_tokens: int, clock: Clock
    ) -> None:
        self._metrics = metrics
        self.engine = engine
        self.num_prompt_tokens = num_prompt_tokens
        self._clock = clock
        self.start_time = clock()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_generation_tokens = 0
        self.is_finished = False

    def on_tokens(self, num_tokens: int) -> None:
        """New tokens arrived (several at once count as one gap, as vLLM counts a step)."""
        if num_tokens <= 0 or self.is_finished:
            return
        now = self._clock()
        if self.last_token_time is None:
            self.first_token_time = now
            self._metrics.observe_first_token(self.engine, now - self.start_time)
        else:
            self._metrics.observe_inter_token(self.engine, now - self.last_token_time)
        self.last_token_time = now
        self.num_generation_tokens += num_tokens

    def finish(self, finish_reason: str) -> None:
        """The request ended; only the first call counts."""
        if self.is_finished:
            return
        self.is_finished = True
        finished = FinishedRequest(
            finish_reason=finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            e2e_latency_s=self._clock() - self.start_time,
        )
        self._metrics.observe_finished(self.engine, finished)
