"""A sweep's runs as one picture: output tokens/s against median TPOT and TTFT, a point per
run, labelled with its rate or concurrency (how the field compares serving engines)."""

from __future__ import annotations

from pathlib import Path

from engine_svc.bench.metrics import Summary


def plot_sweep(runs: list[Summary], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display
        import matplotlib.pyplot as plt
    except ImportError as error:  # the `bench` extra
        raise SystemExit("--plot needs matplotlib: pip install 'duoserve[bench]'") from error
    done = [run for run in runs if run.get("output_throughput")]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for axis, latency, label in (
        (axes[0], "median_tpot_ms", "median time per output token (ms)"),
        (axes[1], "median_ttft_ms", "median time to first token (ms)"),
    ):
        xs = [float(run[latency] or 0) for run in done]
        ys = [float(run["output_throughput"] or 0) for run in done]
        axis.plot(xs, ys, marker="o")
        for run, x, y in zip(done, xs, ys, strict=True):
            axis.annotate(_label(run), (x, y), textcoords="offset points", xytext=(4, 4),
                          fontsize=8)  # fmt: skip
        axis.set_xlabel(label)
        axis.set_ylabel("output tokens/s")
        axis.grid(alpha=0.3)
    figure.suptitle("duoserve: throughput against latency")
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _label(run: Summary) -> str:
    if run.get("max_concurrency"):
        return f"c={run['max_concurrency']}"
    return f"{run['request_rate']} req/s"
