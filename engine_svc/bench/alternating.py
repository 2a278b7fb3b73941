"""The offline benchmark's measurement and its figures: the workload, each system's timed
rounds (alternated, see worker.py), and the summary and table printed from them, for our
engine, Hugging Face and, when given, a vLLM build (vllm_worker.py)."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from engine_svc.bench import ceiling
from engine_svc.bench.worker import Worker

SINGLE_PROMPT_LEN = 128
NUM_TTFT_TRIALS = 3
LABELS = {"ours": "ours", "hf": "HF", "vllm": "vLLM"}  # the systems, in the table's order

Summary = dict[str, float | int | str | None]  # the figures, as printed in the JSON line


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    single_prompt: list[int]
    output_len: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return len(self.prompts) * self.output_len


@dataclasses.dataclass(frozen=True)
class SystemResult:
    """One system's figures: start-up, the batched runs, and one request on its own."""

    start_s: float
    batch_rounds: list[float]
    single_rounds: list[float]  # one request to `output_len` new tokens
    ttft_s: float  # the same request to one new token, the best of NUM_TTFT_TRIALS
    outputs: list[list[int]]  # the first batch's

    @property
    def batch_s(self) -> float:
        return float(np.median(self.batch_rounds))

    @property
    def single_s(self) -> float:
        return float(np.median(self.single_rounds))

    def tokens_per_s(self, workload: Workload) -> float:
        return workload.num_output_tokens / self.batch_s

    def ms_per_token(self, workload: Workload) -> float:
        return 1000 * self.single_s / workload.output_len

    def decode_ms_per_token(self, workload: Workload) -> float:
        return 1000 * (self.single_s - self.ttft_s) / max(workload.output_len - 1, 1)


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len, size=args.num_prompts, endpoint=True)
    prompts = [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lengths]
    single = rng.integers(0, vocab_size, size=SINGLE_PROMPT_LEN).tolist()
    return Workload(prompts=prompts, single_prompt=single, output_len=args.output_len)


def measure_alternating(workers: dict[str, Worker], rounds: int) -> dict[str, SystemResult]:
    """Each round runs the batch on every system in turn, then one request alone on each;
    the best time to first token of NUM_TTFT_TRIALS comes last."""
    batches: dict[str, list[float]] = {name: [] for name in workers}
    singles: dict[str, list[float]] = {name: [] for name in workers}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(rounds):
        for name, worker in workers.items():
            answer = worker.ask("batch")
            batches[name].append(answer["seconds"])
            outputs.setdefault(name, answer["outputs"])
        for name, worker in workers.items():
            singles[name].append(worker.ask("single")["seconds"])
    ttft = {name: min(w.ask("ttft")["seconds"] for _ in range(NUM_TTFT_TRIALS))
            for name, w in workers.items()}  # fmt: skip
    return {
        name: SystemResult(worker.start_s, batches[name], singles[name], ttft[name], outputs[name])
        for name, worker in workers.items()
    }


def summarize(
    workload: Workload,
    results: dict[str, SystemResult],
    ceilings: ceiling.Ceilings,
    num_params: int,
    bytes_per_param: int,
) -> Summary:
    """Every system's figures; ours/HF and vLLM/HF ratios where Hugging Face ran, ours/vLLM
    where vLLM did; the ceilings, and the fractions of them each system reaches (ours as
    `mfu` and `mbu`, the others as `hf_mfu`, `vllm_mbu`...)."""
    ours = results["ours"]

    def utilization(result: SystemResult) -> Summary:
        processed_per_s = (workload.num_prompt_tokens + workload.num_output_tokens) / result.batch_s
        decode_s = result.decode_ms_per_token(workload) / 1000
        return ceiling.utilization_figures(
            ceilings, num_params, bytes_per_param, processed_per_s, decode_s
        )

    summary: Summary = {
        "rounds": len(ours.batch_rounds),
        "num_prompts": len(workload.prompts),
        "prompt_tokens": workload.num_prompt_tokens,
        "output_len": workload.output_len,
        **_figures("ours", ours, workload),
        **utilization(ours),
    }
    for name, result in results.items():
        if name != "ours":
            figures = utilization(result)
            summary |= {f"{name}_mfu": figures["mfu"], f"{name}_mbu": figures["mbu"]}
    hf, vllm = results.get("hf"), results.get("vllm")
    if hf is not None:
        summary |= _figures("hf", hf, workload) | _ratios("", ours, hf, "hf")
    if vllm is not None:
        summary |= _figures("vllm", vllm, workload)
        if hf is not None:
            summary |= _ratios("vllm_", vllm, hf, "hf")
        summary["ours_over_vllm"] = _ratios("", ours, vllm, "vllm")["throughput_ratio"]
    return summary


def _ratios(prefix: str, system: SystemResult, baseline: SystemResult, name: str) -> Summary:
    # Round by round: each ratio compares the two under the same conditions.
    pairs = zip(system.batch_rounds, baseline.batch_rounds, strict=True)
    throughput = [b / s for s, b in pairs]
    pairs = zip(system.single_rounds, baseline.single_rounds, strict=True)
    latency = [s / b for s, b in pairs]
    outputs = zip(system.outputs, baseline.outputs, strict=True)
    return {
        f"{prefix}throughput_ratio": float(np.median(throughput)),
        f"{prefix}throughput_ratio_min": min(throughput),
        f"{prefix}throughput_ratio_max": max(throughput),
        f"{prefix}latency_ratio": float(np.median(latency)),
        f"{prefix}outputs_equal_{name}": sum(a == b for a, b in outputs),
    }


def _figures(name: str, result: SystemResult, workload: Workload) -> Summary:
    return {
        f"{name}_start_s": result.start_s,
        f"{name}_batch_s": result.batch_s,
        f"{name}_tok_s": result.tokens_per_s(workload),
        f"{name}_ms_per_tok": result.ms_per_token(workload),
        # None where noise exceeded the decode time (a very short request).
        f"{name}_decode_ms_per_tok": decode
        if (decode := result.decode_ms_per_token(workload)) > 0
        else None,
        f"{name}_ttft_ms": 1000 * result.ttft_s,
    }


def print_table(summary: Summary, dtype: str) -> None:
    def cell(key: str, spec: str) -> str:
        value = summary.get(key)
        return "-" if value is None else format(value, spec)

    rows = [
        ("start-up (s)", "start_s", ".1f"),
        ("batch wall time (s)", "batch_s", ".1f"),
        ("batch output tokens/s", "tok_s", ".1f"),
        ("1 request: ms/output token", "ms_per_tok", ".1f"),
        ("1 request: decode ms/token", "decode_ms_per_tok", ".1f"),
        ("1 request: TTFT (ms)", "ttft_ms", ".0f"),
    ]
    systems = [name for name in LABELS if f"{name}_tok_s" in summary]
    print(
        f"\n{summary['num_prompts']} prompts ({summary['prompt_tokens']} prompt tokens) x "
        f"{summary['output_len']} new tokens, greedy, {dtype}"
    )
    print(f"{'':30}" + "".join(f"{LABELS[name]:>10}" for name in systems))
    for label, key, spec in rows:
        print(f"{label:30}" + "".join(f"{cell(f'{name}_{key}', spec):>10}" for name in systems))
    for prefix, name in (("", "ours"), ("vllm_", "vLLM")):
        if f"{prefix}throughput_ratio" in summary:
            print(
                f"throughput {name}/HF: {cell(prefix + 'throughput_ratio', '.2f')}x (median of "
                f"{summary['rounds']} alternating rounds; "
                f"{cell(prefix + 'throughput_ratio_min', '.2f')}x-"
                f"{cell(prefix + 'throughput_ratio_max', '.2f')}x)   "
                f"ms per token {name}/HF: {cell(prefix + 'latency_ratio', '.2f')}x (lower is "
                f"better)   outputs equal to HF: {cell(prefix + 'outputs_equal_hf', 'd')}/"
                f"{summary['num_prompts']}"
            )
    if "ours_over_vllm" in summary:
        print(f"throughput ours/vLLM: {cell('ours_over_vllm', '.2f')}x (median of the rounds)")
    print(ceiling.describe(summary))
    for name in systems[1:]:
        print(_baseline_utilization(summary, name))


def _baseline_utilization(summary: Summary, name: str) -> str:
    """A baseline's fractions of the ceilings, and the ratio they put within reach: both
    systems' MFU count the same FLOPs, so the ratio of the batches' (median) times is our
    MFU over the baseline's, and 1 / its MFU is that ratio with our batch at the measured
    GEMM ceiling (not a hard limit: the ceiling is one 2048 x 2048 product, and attention's
    FLOPs are not counted)."""
    mfu, mbu = summary.get(f"{name}_mfu"), summary.get(f"{name}_mbu")
    if not mfu:
        return f"{LABELS[name]}: no MFU"
    decode = "not measurable" if mbu is None else f"{100 * float(mbu):.1f}%"
    return (
        f"{LABELS[name]}: MFU of the batch {100 * float(mfu):.1f}% (ours/{LABELS[name]} "
        f"with ours at the GEMM ceiling: {1 / float(mfu):.2f}x), MBU of 1-request decode {decode}"
    )
