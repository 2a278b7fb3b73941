"""A vLLM build as a third system of the offline benchmark (`--vllm-python PATH`).

vLLM lives in an environment of its own (its torch is not ours), so its worker runs under
that environment's Python with this repository on PYTHONPATH, and imports nothing beyond the
standard library, vLLM and worker.py's command loop (standard library only too). The parent
writes the workload to a JSON file: the very token ids the other systems run.

    PATH/TO/python -m engine_svc.bench.vllm_worker --model DIR --workload FILE
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from engine_svc.bench.worker import serve_workload

REPO_ROOT = Path(__file__).resolve().parents[2]

GenerateFn = Callable[[list[list[int]], int], list[list[int]]]


def command(
    python: str, model: str, dtype: str, seed: int, workload: Path,
    gpu_memory_utilization: float = 0.9,
) -> list[str]:  # fmt: skip
    return [python, "-m", "engine_svc.bench.vllm_worker", "--model", model, "--dtype", dtype,
            "--seed", str(seed), "--workload", str(workload),
            "--gpu-memory-utilization", str(gpu_memory_utilization)]  # fmt: skip


def environment() -> dict[str, str]:
    """The parent's environment, with this repository first on PYTHONPATH."""
    paths = [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


@contextlib.contextmanager
def vllm_system(
    model: str, dtype: str, seed: int, gpu_memory_utilization: float
) -> Iterator[GenerateFn]:
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found, unused-ignore]

    # On a GPU, its share beside our engine's (a CPU build reads its own KV-space setting).
    llm: Any = LLM(model=model, dtype=dtype, seed=seed,
                   gpu_memory_utilization=gpu_memory_utilization)  # fmt: skip

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        llm.reset_prefix_cache()  # each timed run starts cold, as ours and Hugging Face's do
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        requests = [{"prompt_token_ids": prompt} for prompt in prompts]
        outputs = llm.generate(requests, params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    yield generate


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m engine_svc.bench.vllm_worker")
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", required=True, help="the JSON file the parent wrote")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args()
    system = functools.partial(
        vllm_system, args.model, args.dtype, args.seed, args.gpu_memory_utilization
    )
    serve_workload(system, Path(args.workload))


if __name__ == "__main__":
    main()
