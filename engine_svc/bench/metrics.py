"""A serving run's figures, as vLLM's `bench serve` defines them.

Per request: TTFT (send to the first token), E2E (send to the last), TPOT
((E2E - TTFT) / (output tokens - 1)) and ITL (the gaps between streamed chunks, one per
chunk whatever tokens it carried, as vLLM counts them). Over the run:
requests, output and total tokens per second of the run's duration (its start to the end of
its last request, failed ones included), and mean, median, p90 and p99 of each latency, in
milliseconds.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PERCENTILES = (50, 90, 99)
Summary = dict[str, float | int | str | None]


@dataclasses.dataclass
class RequestRecord:
    sent_at: float
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # a time per chunk
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.sent_at

    @property
    def e2e_s(self) -> float:
        return self.chunk_times[-1] - self.sent_at

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def summarize(records: list[RequestRecord], duration: float) -> Summary:
    """The run's figures; `duration`: seconds from its start until every request ended."""
    done = [r for r in records if r.ok]
    summary: Summary = {"completed": len(done), "failed": len(records) - len(done)}
    if not done:
        return summary
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    summary |= {
        "duration_s": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "cached_input_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": len(done) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
    }
    tpots = [t for r in done if (t := r.tpot_s) is not None]
    series = {
        "ttft": [r.ttft_s for r in done],
        "tpot": tpots,
        "itl": [gap for r in done for gap in r.itl_s],
        "e2el": [r.e2e_s for r in done],
    }
    for name, values in series.items():
        summary |= _statistics(name, values)
    return summary


def _statistics(name: str, seconds: list[float]) -> Summary:
    if not seconds:
        return {f"mean_{name}_ms": None}
    ms = 1000 * np.asarray(seconds)
    figures: Summary = {f"mean_{name}_ms": float(ms.mean())}
    for p in PERCENTILES:
        key = f"median_{name}_ms" if p == 50 else f"p{p}_{name}_ms"
        figures[key] = float(np.percentile(ms, p))
    return figures


def format_table(summary: Summary, title: str) -> str:
    """The run's figures as lines of text, like vLLM's report."""
    lines = [f"{'=' * 20} {title} {'=' * 20}"]

    def row(label: str, key: str, spec: str) -> None:
        value = summary.get(key)
        lines.append(f"{label:<40}{'-' if value is None else format(value, spec):>12}")

    row("Successful requests:", "completed", "d")
    row("Failed requests:", "failed", "d")
    row("Benchmark duration (s):", "duration_s", ".2f")
    row("Total input tokens:", "total_input_tokens", "d")
    row("  of which from the prefix cache:", "cached_input_tokens", "d")
    row("Total generated tokens:", "total_output_tokens", "d")
    row("Request throughput (req/s):", "request_throughput", ".2f")
    row("Output token throughput (tok/s):", "output_throughput", ".1f")
    row("Total token throughput (tok/s):", "total_token_throughput", ".1f")
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token "
                        "(excl. 1st)"), ("itl", "Inter-token Latency"), ("e2el", "End-to-end "
                        "Latency")):  # fmt: skip
        lines.append(f"{'-' * 10} {label} {'-' * 10}")
        row(f"Mean {name.upper()} (ms):", f"mean_{name}_ms", ".2f")
        row(f"Median {name.upper()} (ms):", f"median_{name}_ms", ".2f")
        for p in PERCENTILES[1:]:
            row(f"P{p} {name.upper()} (ms):", f"p{p}_{name}_ms", ".2f")
    return "\n".join(lines)
