"""Every metric the services export: name, type, help text, labels and buckets, as vLLM's
v1 engine defines them (vllm/v1/metrics/loggers.py) and go-grpc-prometheus names its gRPC
server metrics. Services build their metrics from these specs; tests and the dashboard check
read the names from here."""

from __future__ import annotations

import dataclasses
import enum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ENGINE_LABELS = ("model_name", "engine")
GRPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Prometheus' (and go-grpc-prometheus') default buckets.
GRPC_HANDLING_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Kind(enum.StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    documentation: str
    labels: tuple[str, ...] = ENGINE_LABELS
    # Histograms only; None: token counts, 1-2-5 buckets up to the model length (as vLLM).
    buckets: tuple[float, ...] | None = None

    @property
    def series_names(self) -> tuple[str, ...]:
        """The names Prometheus stores: counters gain _total, histograms their three series."""
        if self.kind == Kind.COUNTER:
            return (f"{self.name}_total",)
        if self.kind == Kind.HISTOGRAM:
            return tuple(f"{self.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        return (self.name,)

    def gauge(self, registry: CollectorRegistry) -> Gauge:
        self._check(Kind.GAUGE)
        return Gauge(self.name, self.documentation, self.labels, registry=registry)

    def counter(self, registry: CollectorRegistry) -> Counter:
        self._check(Kind.COUNTER)
        return Counter(self.name, self.documentation, self.labels, registry=registry)

    def histogram(self, registry: CollectorRegistry, max_model_len: int = 0) -> Histogram:
        self._check(Kind.HISTOGRAM)
        buckets = self.buckets if self.buckets is not None else build_1_2_5_buckets(max_model_len)
        return Histogram(
            self.name, self.documentation, self.labels, registry=registry, buckets=buckets
        )

    def _check(self, kind: Kind) -> None:
        if self.kind != kind:
            raise TypeError(f"{self.name} is a {self.kind}, not a {kind}")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (at least the bucket 1)."""
    buckets: list[int] = []
    power = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * power
            if value > max_value and buckets:
                return tuple(buckets)
            buckets.append(value)
        power *= 10


def _gauge(name: str, documentation: str) -> MetricSpec:
    return MetricSpec(name, Kind.GAUGE, documentation)


def _counter(name: str, documentation: str) -> MetricSpec:
    return MetricSpec(name, Kind.COUNTER, documentation)


def _histogram(name: str, documentation: str, buckets: tuple[float, ...] | None) -> MetricSpec:
    return MetricSpec(name, Kind.HISTOGRAM, documentation, buckets=buckets)


# ---- per engine rank, from the scheduler's stats (label engine = the data-parallel rank) ----
NUM_REQUESTS_RUNNING = _gauge(
    "vllm:num_requests_running", "Number of requests in model execution batches."
)
NUM_REQUESTS_WAITING = _gauge(
    "vllm:num_requests_waiting", "Number of requests waiting to be processed."
)
KV_CACHE_USAGE = _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
PREFIX_CACHE_QUERIES = _counter(
    "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
)
PREFIX_CACHE_HITS = _counter(
    "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
)
NUM_PREEMPTIONS = _counter(
    "vllm:num_preemptions", "Cumulative number of preemption from the engine."
)
PROMPT_TOKENS = _counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
GENERATION_TOKENS = _counter("vllm:generation_tokens", "Number of generation tokens processed.")
ITERATION_TOKENS = _histogram(
    "vllm:iteration_tokens_total",
    "Histogram of number of tokens per engine_step.",
    ITERATION_TOKENS_BUCKETS,
)
# Not vLLM's: the batch queue of pipeline parallelism.
NUM_BATCHES_IN_FLIGHT = _gauge(
    "duoserve_num_batches_in_flight",
    "Batches the executor runs at once (up to the pipeline-parallel size).",
)
ENGINE_METRICS = (
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    KV_CACHE_USAGE,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    NUM_PREEMPTIONS,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    ITERATION_TOKENS,
    NUM_BATCHES_IN_FLIGHT,
)

# ---- per request --------------------------------------------------------------------------
REQUEST_SUCCESS = MetricSpec(
    "vllm:request_success",
    Kind.COUNTER,
    "Count of successfully processed requests.",
    labels=(*ENGINE_LABELS, "finished_reason"),
)
TIME_TO_FIRST_TOKEN = _histogram(
    "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
)
INTER_TOKEN_LATENCY = _histogram(
    "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
)
E2E_REQUEST_LATENCY = _histogram(
    "vllm:e2e_request_latency_seconds",
    "Histogram of e2e request latency in seconds.",
    REQUEST_LATENCY_BUCKETS,
)
REQUEST_QUEUE_TIME = _histogram(
    "vllm:request_queue_time_seconds",
    "Histogram of time spent in WAITING phase for request.",
    REQUEST_LATENCY_BUCKETS,
)
REQUEST_PREFILL_TIME = _histogram(
    "vllm:request_prefill_time_seconds",
    "Histogram of time spent in PREFILL phase for request.",
    REQUEST_LATENCY_BUCKETS,
)
REQUEST_DECODE_TIME = _histogram(
    "vllm:request_decode_time_seconds",
    "Histogram of time spent in DECODE phase for request.",
    REQUEST_LATENCY_BUCKETS,
)
REQUEST_PROMPT_TOKENS = _histogram(
    "vllm:request_prompt_tokens", "Number of prefill tokens processed.", None
)
REQUEST_GENERATION_TOKENS = _histogram(
    "vllm:request_generation_tokens", "Number of generation tokens processed.", None
)
REQUEST_METRICS = (
    REQUEST_SUCCESS,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    E2E_REQUEST_LATENCY,
    REQUEST_QUEUE_TIME,
    REQUEST_PREFILL_TIME,
    REQUEST_DECODE_TIME,
    REQUEST_PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
)

# ---- gRPC servers (go-grpc-prometheus) ------------------------------------------------------
GRPC_SERVER_STARTED = MetricSpec(
    "grpc_server_started",
    Kind.COUNTER,
    "Total number of RPCs started on the server.",
    labels=GRPC_LABELS,
)
GRPC_SERVER_HANDLED = MetricSpec(
    "grpc_server_handled",
    Kind.COUNTER,
    "Total number of RPCs completed on the server, regardless of success or failure.",
    labels=(*GRPC_LABELS, "grpc_code"),
)
GRPC_SERVER_HANDLING_SECONDS = MetricSpec(
    "grpc_server_handling_seconds",
    Kind.HISTOGRAM,
    "Histogram of response latency (seconds) of gRPC that had been application-level "
    "handled by the server.",
    labels=GRPC_LABELS,
    buckets=GRPC_HANDLING_BUCKETS,
)
GRPC_SERVER_METRICS = (GRPC_SERVER_STARTED, GRPC_SERVER_HANDLED, GRPC_SERVER_HANDLING_SECONDS)

ALL_METRICS = ENGINE_METRICS + REQUEST_METRICS + GRPC_SERVER_METRICS
