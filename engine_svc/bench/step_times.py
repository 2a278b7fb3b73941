"""Where a batch's time goes: the offline workload through our engine in this process, with
timers around the model runner's calls, split into prompt steps and decode steps, and each
decode step into the forward (the layers), the logits (the LM head), sampling and the rest
of the runner (inputs, state). Timers, not the torch profiler: that one doubled the LM
head's time on the Zen 5 and sees only the thread it started on.

    python -m engine_svc.bench steps --model DIR [--dtype bfloat16] [--rounds 2] [--isa avx2]
        [--temperature T [--top-p P] [--top-k K] [--min-p M] [--sampling-seed S]]
        [--logprobs N] [--repetition-penalty R] [--frequency-penalty F] [--presence-penalty P]

Greedy unless --temperature is above 0: then every request samples with those filters (the
sampling part of a decode step is theirs), unseeded, or with --sampling-seed each seeded
(seeded rows race: engine_svc/worker/seeded_sampling.py). --logprobs N: every request
wants its tokens' logprobs and its N most likely tokens'; the penalties apply to every
request (both in the sampling part too). A step counts as a decode step when every request
it runs takes one token; a step with any prompt chunk in it is a prompt step. The rounds start
once the engine's KV cache is mapped in (offline mode's wait).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from engine_svc.bench import machine, options
from engine_svc.bench.alternating import make_workload
from engine_svc.bench.hardware import DTYPES
from engine_svc.bench.load import vocab_size_of
from engine_svc.core.sched.output import SchedulerOutput
from engine_svc.sampling_params import SamplingParams
from shared.errors import InvalidRequestError

DECODE_PARTS = ("forward", "logits", "sampling")


@dataclass
class StepTimes:
    """Seconds of one batch: wall clock, and the runner's steps by kind."""

    batch_s: float = 0.0
    prompt_steps: int = 0
    prompt_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0
    # Seconds of the decode steps' parts (DECODE_PARTS), summed over those steps.
    decode_parts_s: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(DECODE_PARTS, 0.0)
    )

    def describe(self) -> str:
        per_step = 1e3 / max(self.decode_steps, 1)
        parts = {name: seconds * per_step for name, seconds in self.decode_parts_s.items()}
        rest = self.decode_s * per_step - sum(parts.values())
        listed = ", ".join(f"{name} {ms:.2f}" for name, ms in parts.items())
        return (
            f"batch {self.batch_s:.2f} s: {self.prompt_steps} prompt steps {self.prompt_s:.2f} s, "
            f"{self.decode_steps} decode steps {self.decode_s:.2f} s "
            f"({self.decode_s * per_step:.2f} ms each: {listed}, rest {rest:.2f}), "
            f"outside the runner {self.batch_s - self.prompt_s - self.decode_s:.2f} s"
        )


def is_decode_step(scheduler_output: SchedulerOutput) -> bool:
    return all(len(s.token_ids) == 1 for s in scheduler_output.scheduled)


@contextlib.contextmanager
def timed_runner(runner: Any, times: StepTimes) -> Iterator[None]:
    """Timers around `runner`'s calls (a ModelRunner in this process) while the block runs;
    the runner's own methods come back after."""
    model = runner.model
    in_decode = [False]

    def timed(call: Callable[..., Any], part: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                if in_decode[0]:
                    times.decode_parts_s[part] += time.perf_counter() - began

        return wrapper

    execute_model = runner.execute_model
    sample_tokens = runner.sample_tokens

    def timed_execute(scheduler_output: SchedulerOutput) -> Any:
        decode = is_decode_step(scheduler_output)
        in_decode[0] = decode
        began = time.perf_counter()
        try:
            return execute_model(scheduler_output)
        finally:
            seconds = time.perf_counter() - began
            if scheduler_output.scheduled and decode:
                times.decode_steps += 1
                times.decode_s += seconds
            elif scheduler_output.scheduled:
                times.prompt_steps += 1
                times.prompt_s += seconds

    runner.execute_model = timed_execute
    # Constrained requests sample in a second call; others inside execute_model.
    runner.sample_tokens = timed(sample_tokens, "sampling")
    model.forward = timed(model.forward, "forward")
    model.compute_logits = timed(model.compute_logits, "logits")
    try:
        yield
    finally:
        for name in ("execute_model", "sample_tokens"):
            delattr(runner, name)
        for name in ("forward", "compute_logits"):
            delattr(model, name)


def measure(args: argparse.Namespace) -> list[StepTimes]:
    """The workload's batch `args.rounds` times (after a warm-up), each cold: no prefix-cache
    hits, as offline mode runs it."""
    from engine_svc import LLM

    vocab_size = vocab_size_of(args.model)
    assert vocab_size is not None, "the model directory is required"
    workload = make_workload(args, vocab_size)
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.num_threads)
    try:
        params = sampling_params(args, max_tokens=workload.output_len)
        llm.generate([workload.single_prompt[:8]], SamplingParams(max_tokens=4, ignore_eos=True))
        # Timed once the KV cache is mapped in, as offline mode times ours: the batch ran
        # beside its idle-priority populating thread before.
        from engine_svc.bench.offline import kv_cache_mapped_in

        kv_cache_mapped_in()
        runner = llm.engine_core.executor.runner
        rounds = []
        for _ in range(args.rounds):
            times = StepTimes()
            llm.client.reset_prefix_cache()
            with timed_runner(runner, times):
                began = time.perf_counter()
                llm.generate(workload.prompts, params)
                times.batch_s = time.perf_counter() - began
            rounds.append(times)
        return rounds
    finally:
        llm.shutdown()


def sampling_params(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        logprobs=args.logprobs,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        max_tokens=max_tokens,
        ignore_eos=True,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m engine_svc.bench steps", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="batches timed, one line each")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads")
    parser.add_argument("--result-file", help="write the rounds as JSON here")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: every token")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument(
        "--sampling-seed", type=int, default=None, help="seed every request's sampling"
    )
    parser.add_argument("--logprobs", type=int, default=None, help="top logprobs a token")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    options.add_isa_option(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    options.require_positive(parser, args, ["num_prompts", "output_len", "min_len", "rounds"])
    options.require_ordered(parser, args, "min_len", "max_len")
    try:
        sampling_params(args, max_tokens=1).validate()
    except InvalidRequestError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    options.rerun_capped(args, "steps")
    print(machine.describe(DTYPES[args.dtype]), flush=True)
    rounds = measure(args)
    for index, times in enumerate(rounds, 1):
        print(f"round {index}: {times.describe()}", flush=True)
    if args.result_file:
        with open(args.result_file, "w") as file:
            json.dump([asdict(times) for times in rounds], file, indent=2)
