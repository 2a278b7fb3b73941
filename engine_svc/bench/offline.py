"""Offline benchmark: our engine against Hugging Face `generate` on the same weights and
prompts, with the machine's GEMM and copy ceilings measured in the same run (DESIGN.md 6).

    python -m engine_svc.bench [offline] --model DIR [--skip-hf] [--rounds N] [--isa avx2]
        [--vllm-python PATH] [--device cuda]

On a CUDA device (`--device`, by default CUDA when torch sees one) both systems run there and
the ceilings are the device's (ceiling_cuda.py).

Each system runs in a process of its own (worker.py), so none inherits another's threads,
allocator settings or warm memory: our engine tunes glibc malloc for its process, Hugging
Face is measured as its users run it, and a vLLM build runs in its own environment
(vllm_worker.py). They are then alternated, round after round (batch, then one request
alone), and the figures are medians: per system, and for the ratios, the median of each
round's ratio, which compares the systems under the same conditions on a machine whose speed
drifts (alternating.py). Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from engine_svc.bench import ceiling, hardware, machine, vllm_worker
from engine_svc.bench.alternating import (
    Summary,
    Workload,
    make_workload,
    measure_alternating,
    print_table,
    summarize,
)
from engine_svc.bench.worker import Worker, serve, serve_workload, write_workload
from engine_svc.worker.model_runner import resolve_device

# Our engine's share of a CUDA device's memory: alone on it, or beside the other systems.
ALONE_SHARE = 0.9
SHARED_SHARE = 0.45
# The longest our worker waits for its engine's KV cache to be mapped in before timing.
KV_CACHE_WAIT_S = 120.0

# Runs prompts (token ids) to a fixed number of new tokens; returns the new tokens.
GenerateFn = Callable[[list[list[int]], int], list[list[int]]]


@contextlib.contextmanager
def engine_system(args: argparse.Namespace, num_threads: int) -> Iterator[GenerateFn]:
    from engine_svc import LLM, SamplingParams

    parallel = args.tensor_parallel_size * args.pipeline_parallel_size > 1
    llm = LLM(
        args.model,
        dtype=args.dtype,
        # Worker processes split the cores among themselves.
        num_threads=None if parallel else num_threads,
        num_kv_blocks=args.num_kv_blocks,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        enforce_eager=args.enforce_eager,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        # Each timed run starts cold, as Hugging Face does: no prefix-cache hits.
        llm.client.reset_prefix_cache()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [output.token_ids for output in llm.generate(prompts, params)]

    try:
        yield generate
    finally:
        llm.shutdown()


@contextlib.contextmanager
def hf_system(args: argparse.Namespace) -> Iterator[GenerateFn]:
    from transformers import AutoModelForCausalLM

    device = args.torch_device
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=hardware.DTYPES[args.dtype])
    model = model.to(device).eval()  # type: ignore[arg-type]
    pad_id = model.config.pad_token_id
    if pad_id is None:
        pad_id = model.config.eos_token_id

    @torch.inference_mode()
    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        input_ids, attention_mask = _left_pad(prompts, pad_id)
        sequences = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,  # EOS suppressed, as ignore_eos does for us
            do_sample=False,
            pad_token_id=pad_id,
        )
        return sequences[:, input_ids.shape[1] :].tolist()

    yield generate


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


def measure_structured(args: argparse.Namespace) -> Summary:
    """Engine steps per second with 32 JSON-schema requests against 32 free ones."""
    from engine_svc import LLM
    from engine_svc.bench.structured import compare

    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, num_kv_blocks=1024,
              device=args.device, gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
    try:
        figures = compare(llm)
    finally:
        llm.shutdown()
    print(
        f"structured output: {figures['steps_per_s_json']:.2f} steps/s with 32 JSON-schema "
        f"requests, {figures['steps_per_s_free']:.2f} with 32 free ones "
        f"({figures['json_over_free']:.2f}x)"
    )
    return dict(figures)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m engine_svc.bench [offline]", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=192)
    parser.add_argument("--dtype", choices=sorted(hardware.DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face baseline")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument(
        "--device",
        default="auto",
        help="both systems' device: auto (CUDA when available), cpu, cuda or cuda:N",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="our engine's share of the accelerator's memory (weights, activations, KV "
        f"cache); default {ALONE_SHARE} alone, {SHARED_SHARE} beside Hugging Face or vLLM on it",
    )
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, help="our engine's worker ranks"
    )
    parser.add_argument(
        "--pipeline-parallel-size", "-pp", type=int, default=1, help="our engine's stages"
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="our engine's decode steps through the model's Python loop (not the C++ one)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds of each system (medians)"
    )
    parser.add_argument(
        "--skip-structured", action="store_true", help="skip the structured-output step rate"
    )
    parser.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="the Python of an environment with a vLLM build: runs it as a third system on "
        "the same prompts (vllm_worker.py)",
    )
    parser.add_argument(
        "--isa",
        choices=sorted(machine.ISA_CAPS),
        help="hold torch, MKL, oneDNN and our kernels to this vector level (on a CPU that has "
        "more): what a machine with only it runs",
    )
    # Internal: serve one system as a bench worker (ours, hf), or measure the structured
    # output rate and write it to --result-file as JSON.
    parser.add_argument("--system", choices=["ours", "hf", "structured"], help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    # Internal: the worker runs these token ids (worker.write_workload), not a random workload.
    parser.add_argument("--workload-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.system == "structured" and not args.result_file:
        parser.error("--system structured needs --result-file")
    if args.vllm_python and not os.access(args.vllm_python, os.X_OK):
        parser.error(f"--vllm-python {args.vllm_python}: not an executable file")
    if args.rounds < 1:
        parser.error("need --rounds >= 1")
    if args.gpu_memory_utilization is not None and not 0.0 < args.gpu_memory_utilization <= 1.0:
        parser.error("need 0 < --gpu-memory-utilization <= 1")
    try:
        args.torch_device = device = resolve_device(args.device)
    except RuntimeError as error:
        parser.error(f"--device {args.device}: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device here")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: cpu or cuda")
    if args.gpu_memory_utilization is None:
        # Every system stays loaded while the rounds alternate: on one GPU they share it.
        alone = args.skip_hf and not args.vllm_python
        args.gpu_memory_utilization = ALONE_SHARE if alone else SHARED_SHARE
    if not 1 <= args.min_len <= args.max_len:
        parser.error("need 1 <= --min-len <= --max-len")
    if args.tensor_parallel_size < 1 or args.pipeline_parallel_size < 1:
        parser.error("need --tensor-parallel-size and --pipeline-parallel-size >= 1")
    if args.num_prompts < 1 or args.output_len < 1:
        parser.error("need --num-prompts and --output-len >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.system is not None:
        _run_here(args)
        return
    machine.apply_isa_cap(args.isa, ["-m", "engine_svc.bench", "offline", *args.argv])
    device = args.torch_device
    on_cpu = device.type == "cpu"
    if (
        on_cpu
        and args.dtype == "bfloat16"
        and not args.skip_hf
        and not machine.has_bf16_arithmetic()
    ):
        # torch's bfloat16 matmul runs a scalar path there: Hugging Face would take hours.
        print(
            "Hugging Face bfloat16 skipped: this CPU has no bfloat16 arithmetic (AVX512-BF16 "
            "or AMX-BF16), so torch multiplies bfloat16 matrices in scalar code"
        )
        args.skip_hf = True
    structured = {} if args.skip_structured else _in_subprocess(args, "structured")
    config = json.loads((Path(args.model) / "config.json").read_text())
    workload = make_workload(args, config["vocab_size"])
    workers: dict[str, Worker] = {}
    with tempfile.TemporaryDirectory(prefix="duoserve-bench-") as folder:
        try:  # started one after the other, so that each start-up is timed alone
            for name in ("ours",) if args.skip_hf else ("ours", "hf"):
                workers[name] = Worker(_command(args, name))
            if args.vllm_python:
                workers["vllm"] = _vllm_worker(args, workload, Path(folder))
            results = measure_alternating(workers, args.rounds)
        finally:
            for worker in workers.values():
                worker.close()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    ceilings = hardware.measure_ceilings(device, hardware.DTYPES[args.dtype])
    bytes_per_param = torch.tensor([], dtype=hardware.DTYPES[args.dtype]).element_size()
    summary = summarize(
        workload, results, ceilings, ceiling.count_parameters(args.model), bytes_per_param
    )
    summary.update(structured)
    summary |= machine.identity()
    summary |= {"tensor_parallel_size": args.tensor_parallel_size,
                "pipeline_parallel_size": args.pipeline_parallel_size}  # fmt: skip
    if not on_cpu:
        summary |= {"device": torch.cuda.get_device_name(device)}
    print(hardware.describe(device, hardware.DTYPES[args.dtype]))
    print_table(summary, args.dtype)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}))


def _vllm_worker(args: argparse.Namespace, workload: Workload, folder: Path) -> Worker:
    """vLLM in its own environment's Python, on the same token ids (vllm_worker.py)."""
    path = folder / "workload.json"
    write_workload(path, workload.prompts, workload.single_prompt, workload.output_len)
    command = vllm_worker.command(args.vllm_python, args.model, args.dtype, args.seed, path,
                                  gpu_memory_utilization=SHARED_SHARE)  # fmt: skip
    return Worker(command, env=vllm_worker.environment())


def _command(args: argparse.Namespace, system: str) -> list[str]:
    return [sys.executable, "-m", "engine_svc.bench", "offline", *args.argv, "--system", system]


def _in_subprocess(args: argparse.Namespace, system: str) -> dict[str, Any]:
    """Run one system's measurement in a fresh Python; its output passes through."""
    with tempfile.TemporaryDirectory(prefix="duoserve-bench-") as folder:
        result = Path(folder) / "result.json"
        subprocess.run([*_command(args, system), "--result-file", str(result)], check=True)
        data: dict[str, Any] = json.loads(result.read_text())
        return data


def _run_here(args: argparse.Namespace) -> None:
    num_threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(num_threads)
    if args.system == "structured":
        Path(args.result_file).write_text(json.dumps(measure_structured(args)))
        return
    if args.system == "ours":
        system = functools.partial(engine_system, args, num_threads)
    else:
        system = functools.partial(hf_system, args)
    settle = kv_cache_mapped_in if args.system == "ours" else None
    if args.workload_file is not None:
        serve_workload(system, args.workload_file, settle)
        return
    config = json.loads((Path(args.model) / "config.json").read_text())
    workload = make_workload(args, config["vocab_size"])
    serve(system, workload.prompts, workload.single_prompt, workload.output_len, settle)


def kv_cache_mapped_in() -> None:
    """Our timed rounds start once the engine's KV cache is mapped in: a CPU engine serves
    while an idle-priority thread faults its pages in (host_memory.py), 7-21 s after start on
    a fresh 2-core VM, and a batch run beside it read 8-10% slow (290 against 313-322 tokens/s,
    `--rounds 1`; 315-328 once it waited). Start-up is timed before this, as a user meets it.
    `bench steps` waits the same way."""
    from engine_svc.worker.host_memory import wait_populated

    began = time.perf_counter()
    if wait_populated(KV_CACHE_WAIT_S):
        print(f"ours: KV cache mapped in {time.perf_counter() - began:.1f} s after warm-up")
    else:
        print(f"ours: KV cache still mapping in after {KV_CACHE_WAIT_S:.0f} s; timing anyway")
