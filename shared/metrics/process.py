"""A service process's own metrics, as prometheus_client's default registry (and so vLLM's
/metrics) has them: process_* from /proc (CPU seconds, resident and virtual memory, open and
maximum file descriptors, start time), python_info, and python_gc_* (the garbage collector's
collections and the objects they freed, by generation). Registered on the service's own
registry, like every other metric here."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector


def register_process_metrics(registry: CollectorRegistry) -> None:
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
