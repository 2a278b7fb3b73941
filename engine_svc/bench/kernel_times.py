"""Our CPU kernels at a model's shapes, against what torch would do in their place:

- decode attention straight from the paged cache (`paged_decode_attention`), every layer in
  turn so the keys and values come from memory as in a decode step, and one layer over and
  over (in cache), against gathering each sequence's keys and values out of the cache and
  torch's SDPA;
- the decoder projections in the layouts the engine picks for the dtype, every layer in turn
  (the weights stream as in a step), at a decode step's rows and at a prompt step's, against
  torch's matmul on the same weights (the engine's path without its kernels);
- prompt attention over a prompt step's chunks (`prefill_attention_`), against SDPA per chunk.

    python -m engine_svc.bench kernels --model DIR [--dtype bfloat16] [--isa avx2]

Each figure is the best of --trials; the two sides of a line run in the same process.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from engine_svc.bench import machine, options
from engine_svc.bench.hardware import DTYPES
from engine_svc.kernels import (
    cpu_kernels_available,
    paged_decode_attention,
    prefill_attention_available,
    torch_bf16_matmul_is_scalar,
)
from engine_svc.layers.linear import Projection
from engine_svc.models.fast_paths import use_fused_ops
from engine_svc.models.llama import ACTIVATIONS, MLP, LlamaForCausalLM
from engine_svc.models.loader import load_model
from engine_svc.models.model_spec import ModelSpec, load_model_spec

BLOCK_SIZE = 16  # the engine's default


@dataclass
class KernelTime:
    """One kernel against torch on the same inputs: seconds, and what they moved or did."""

    name: str
    ours_s: float
    torch_s: float | None  # None: not run (the reason in `note`)
    bytes: int = 0  # read from the cache or the weights, for GB/s
    flops: int = 0
    note: str = ""

    def describe(self) -> str:
        def rate(seconds: float) -> str:
            parts = [f"{seconds * 1e3:.2f} ms"]
            if self.bytes:
                parts.append(f"{self.bytes / seconds / 1e9:.1f} GB/s")
            if self.flops:
                parts.append(f"{self.flops / seconds / 1e9:.0f} GFLOP/s")
            return ", ".join(parts)

        line = f"{self.name}: ours {rate(self.ours_s)}"
        if self.torch_s is not None:
            line += f"; torch {rate(self.torch_s)}; ours {self.torch_s / self.ours_s:.2f}x"
        return line + (f" ({self.note})" if self.note else "")


def best_seconds(run: Callable[[], object], trials: int) -> float:
    run()  # warm-up: pages of the outputs, kernels' first-call setup
    best = math.inf
    for _ in range(trials):
        began = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - began)
    return best


def check_same(name: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Both sides of a line compute the same values (to their dtype's rounding, relative to
    the outputs' scale), or the comparison means nothing."""
    tolerance = 2e-2 if ours.dtype == torch.bfloat16 else 1e-4
    scale = theirs.float().abs().max().item()
    if not torch.allclose(ours.float(), theirs.float(), rtol=tolerance, atol=tolerance * scale):
        worst = (ours.float() - theirs.float()).abs().max().item()
        raise SystemExit(f"{name}: ours and torch's differ by up to {worst:g} (scale {scale:g})")


def context_lengths(args: argparse.Namespace) -> list[int]:
    generator = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(
        args.min_context, args.max_context + 1, (args.num_seqs,), generator=generator
    )
    return [int(n) for n in lengths]


def decode_attention(
    spec: ModelSpec, dtype: torch.dtype, args: argparse.Namespace
) -> list[KernelTime]:
    """All layers' decode attention for `num_seqs` sequences, blocks scattered over the
    caches as a busy engine leaves them."""
    lens = context_lengths(args)
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks)
    generator = torch.Generator().manual_seed(args.seed + 1)
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    start = 0
    for s, count in enumerate(blocks):
        tables[s, :count] = order[start : start + count]
        start += count
    shape = (num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    caches = [
        (
            torch.randn(shape, generator=generator).to(dtype),
            torch.randn(shape, generator=generator).to(dtype),
        )
        for _ in range(spec.num_layers)
    ]
    q = torch.randn(len(lens), spec.num_heads, spec.head_dim, generator=generator).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = spec.head_dim**-0.5
    longest = max(lens)

    def ours(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        for k_cache, v_cache in layers:
            out = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, longest, scale)
        return out

    # Torch: each sequence's slots gathered into [seqs, kv_heads, longest, head_dim], the
    # padding masked, then SDPA with the query heads grouped over the KV heads.
    slots = torch.zeros(len(lens), longest, dtype=torch.long)
    for s, n in enumerate(lens):
        positions = torch.arange(n)
        slots[s, :n] = (
            tables[s, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
        )
    mask = torch.full((len(lens), 1, 1, longest), float("-inf"), dtype=dtype)
    for s, n in enumerate(lens):
        mask[s, ..., :n] = 0
    query = q.unsqueeze(2)

    def gathered(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        for k_cache, v_cache in layers:
            rows = k_cache.view(-1, spec.num_kv_heads, spec.head_dim)
            k = rows.index_select(0, slots.view(-1)).view(len(lens), longest, spec.num_kv_heads, -1)
            rows = v_cache.view(-1, spec.num_kv_heads, spec.head_dim)
            v = rows.index_select(0, slots.view(-1)).view(len(lens), longest, spec.num_kv_heads, -1)
            out = F.scaled_dot_product_attention(
                query, k.transpose(1, 2), v.transpose(1, 2), mask, scale=scale, enable_gqa=True
            )
        return out.squeeze(2)

    check_same("decode attention", ours(caches[:1]), gathered(caches[:1]))
    kv_bytes = 2 * sum(lens) * spec.num_kv_heads * spec.head_dim * dtype.itemsize
    workload = f"{len(lens)} sequences of {min(lens)}-{max(lens)} tokens"
    return [
        KernelTime(
            f"decode attention, {spec.num_layers} layers from memory",
            best_seconds(lambda: ours(caches), args.trials),
            best_seconds(lambda: gathered(caches), args.trials),
            bytes=kv_bytes * spec.num_layers,
            note=workload,
        ),
        KernelTime(
            "decode attention, one layer in cache",
            best_seconds(lambda: ours(caches[:1] * 10), args.trials) / 10,
            best_seconds(lambda: gathered(caches[:1] * 10), args.trials) / 10,
            bytes=kv_bytes,
        ),
    ]


def decoder_projections(model: LlamaForCausalLM) -> list[ProjectionStep]:
    """Each decoder layer's four projections, in the order a step runs them; gate/up with
    the MLP's activation, which our kernels may compute as they store gate/up's sums."""
    steps: list[ProjectionStep] = []
    for layer in model.model.local_layers():
        mlp = layer.ffn
        if not isinstance(mlp, MLP):
            raise SystemExit("the projections are timed for models with a dense MLP")
        gate_up = mlp.gate_up
        steps += [
            ProjectionStep(layer.self_attn.qkv),
            ProjectionStep(layer.self_attn.o_proj),
            ProjectionStep(gate_up, functools.partial(gate_up_activation, mlp)),
            ProjectionStep(mlp.down_proj),
        ]
    return steps


def gate_up_activation(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    """act(gate) * up, as the MLP's forward computes it before its down projection."""
    if mlp.fused_act:
        return mlp.gate_up.silu_and_mul(x)
    gate, up = mlp.gate_up(x).chunk(2, dim=-1)
    return ACTIVATIONS[mlp.act](gate) * up


@dataclass
class ProjectionStep:
    """A projection, and what a step computes with it (its forward, unless told)."""

    projection: Projection
    call: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (self.call or self.projection)(x)


def projections(
    model_dir: str, spec: ModelSpec, dtype: torch.dtype, args: argparse.Namespace
) -> list[KernelTime]:
    """The decoder layers' projections in order, at a decode step's rows and a prompt
    step's, as the engine lays them out, against torch's matmul on the same weights (the
    engine's path without its kernels: [in, out] for MKL)."""
    device = torch.device("cpu")
    model = load_model(model_dir, spec, dtype, device)
    use_fused_ops(model, True, dtype, decode_loop=False)
    plain_model = load_model(model_dir, spec, dtype, device)
    use_fused_ops(plain_model, False, dtype, decode_loop=False)
    ours, plain = decoder_projections(model), decoder_projections(plain_model)
    weights = sum(step.projection.in_features * step.projection.out_features for step in ours)
    skip_torch = dtype == torch.bfloat16 and torch_bf16_matmul_is_scalar()
    times = []
    for rows in (args.num_seqs, args.prompt_rows):
        inputs = [torch.randn(rows, step.projection.in_features).to(dtype) for step in ours]
        if rows == args.num_seqs:  # a decode step's rows: torch's side runs even if scalar
            for index, (mine, theirs, x) in enumerate(zip(ours[:4], plain, inputs, strict=False)):
                check_same(f"projection {index} at {rows} rows", mine(x), theirs(x))
        torch_s = None
        if not skip_torch:
            torch_s = best_seconds(
                functools.partial(run_projections, list(zip(plain, inputs, strict=True))),
                args.trials,
            )
        times.append(
            KernelTime(
                f"projections, {len(ours)} at {rows} rows",
                best_seconds(
                    functools.partial(run_projections, list(zip(ours, inputs, strict=True))),
                    args.trials,
                ),
                torch_s,
                bytes=weights * dtype.itemsize if rows == args.num_seqs else 0,
                flops=2 * rows * weights,
                note="gate/up with its activation"
                + (
                    "; torch's bfloat16 matmul is a scalar loop here: not run" if skip_torch else ""
                ),
            )
        )
    return times


def run_projections(calls: list[tuple[ProjectionStep, torch.Tensor]]) -> None:
    for step, x in calls:
        step(x)


def prompt_attention(
    spec: ModelSpec, dtype: torch.dtype, args: argparse.Namespace
) -> list[KernelTime]:
    """One layer's causal attention over a prompt step's chunks (prompts with no cached
    context, packed into prompt_rows tokens)."""
    if not prefill_attention_available(dtype, spec.head_dim):
        print(
            f"prompt attention: our kernel does not serve head_dim {spec.head_dim} here; not timed"
        )
        return []
    generator = torch.Generator().manual_seed(args.seed + 2)
    lens: list[int] = []
    while sum(lens) < args.prompt_rows:
        n = int(torch.randint(args.min_prompt, args.max_prompt + 1, (1,), generator=generator))
        lens.append(min(n, args.prompt_rows - sum(lens)))
    tokens = sum(lens)
    q = torch.randn(tokens, spec.num_heads, spec.head_dim, generator=generator).to(dtype)
    k = torch.randn(tokens, spec.num_kv_heads, spec.head_dim, generator=generator).to(dtype)
    v = torch.randn(tokens, spec.num_kv_heads, spec.head_dim, generator=generator).to(dtype)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0)[:-1].tolist()], dtype=torch.int32)
    query_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.empty_like(q)
    scale = spec.head_dim**-0.5

    def ours() -> torch.Tensor:
        torch.ops.duoserve.prefill_attention_(out, q, k, v, starts, query_lens, scale, 0)
        return out

    def sdpa() -> torch.Tensor:
        chunks = []
        for start, n in zip(starts.tolist(), lens, strict=True):
            chunk = slice(start, start + n)
            attended = F.scaled_dot_product_attention(
                q[chunk].transpose(0, 1),
                k[chunk].transpose(0, 1),
                v[chunk].transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            chunks.append(attended.transpose(0, 1))
        return torch.cat(chunks)

    check_same("prompt attention", ours(), sdpa())

    # Causal: about half of each chunk's score matrix, for QK^T and for PV.
    flops = sum(2 * 2 * n * (n + 1) // 2 * spec.num_heads * spec.head_dim for n in lens)
    return [
        KernelTime(
            f"prompt attention, one layer, {len(lens)} chunks of {tokens} tokens",
            best_seconds(ours, args.trials),
            best_seconds(sdpa, args.trials),
            flops=flops,
        )
    ]


def measure(args: argparse.Namespace) -> list[KernelTime]:
    if not cpu_kernels_available():
        raise SystemExit("the CPU kernels are not available on this machine")
    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    spec = load_model_spec(args.model)
    times: list[KernelTime] = []
    for part in (
        lambda: decode_attention(spec, dtype, args),
        lambda: projections(args.model, spec, dtype, args),
        lambda: prompt_attention(spec, dtype, args),
    ):
        for kernel in part():
            print(kernel.describe(), flush=True)
            times.append(kernel)
    return times


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m engine_svc.bench kernels", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--num-seqs", type=int, default=64, help="decode step rows")
    parser.add_argument("--min-context", type=int, default=130)
    parser.add_argument("--max-context", type=int, default=320)
    parser.add_argument("--prompt-rows", type=int, default=2048, help="prompt step tokens")
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=192)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", help="write the figures as JSON here")
    options.add_isa_option(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    options.require_positive(
        parser, args, ["num_seqs", "min_context", "prompt_rows", "min_prompt", "trials"]
    )
    options.require_ordered(parser, args, "min_context", "max_context")
    options.require_ordered(parser, args, "min_prompt", "max_prompt")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    options.rerun_capped(args, "kernels")
    print(machine.describe(DTYPES[args.dtype]), flush=True)
    times = measure(args)
    if args.result_file:
        with open(args.result_file, "w") as file:
            json.dump([asdict(kernel) for kernel in times], file, indent=2)
