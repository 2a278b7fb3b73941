"""The benchmarks' parts on data the test controls: the serving workloads (lengths, shared
prefixes, a JSON-lines file, arrival times) and the figures computed from streams whose
timings the test writes (vLLM `bench serve`'s definitions), and what the machine reports."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_svc.bench.metrics import RequestRecord, format_table, summarize
from engine_svc.bench.workload import (
    arrival_gaps,
    jsonl_requests,
    random_requests,
    shared_prefix_requests,
)
from shared.errors import InvalidRequestError


def test_random_prompts_are_seeded_within_their_range_with_exact_outputs() -> None:
    requests = random_requests(200, 100, 7, 0.5, vocab_size=50, seed=3)
    lengths = [len(r.prompt_token_ids or []) for r in requests]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 20
    assert {r.output_len for r in requests} == {7}
    assert all(0 <= t < 50 for r in requests for t in r.prompt_token_ids or [])
    assert requests == random_requests(200, 100, 7, 0.5, vocab_size=50, seed=3)
    assert requests != random_requests(200, 100, 7, 0.5, vocab_size=50, seed=4)
    with pytest.raises(InvalidRequestError) as refused:
        random_requests(1, 10, 1, 1.0, vocab_size=50, seed=0)
    assert refused.value.field == "range_ratio"


def test_shared_prefix_groups_share_their_system_prompt_and_interleave() -> None:
    requests = shared_prefix_requests(3, 4, prefix_len=32, suffix_len=5, output_len=2,
                                      vocab_size=1000, seed=0)  # fmt: skip
    assert len(requests) == 12
    prompts = [r.prompt_token_ids or [] for r in requests]
    assert all(len(p) == 37 for p in prompts)
    for i, prompt in enumerate(prompts):  # request i belongs to group i % 3
        assert prompt[:32] == prompts[i % 3][:32]
        assert prompt[:32] != prompts[(i + 1) % 3][:32]
    assert len({tuple(p[32:]) for p in prompts}) == 12


def test_a_jsonl_dataset_takes_text_or_ids_and_names_a_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello"}\n\n{"prompt_token_ids": [1, 2], "output_len": 9}\n')
    first, second = jsonl_requests(path, output_len=4, limit=None)
    assert (first.prompt, first.prompt_token_ids, first.output_len) == ("Hello", None, 4)
    assert (second.prompt, second.prompt_token_ids, second.output_len) == (None, [1, 2], 9)
    assert len(jsonl_requests(path, output_len=4, limit=1)) == 1
    for bad, where in (('{"prompt": "a"}\n{oops\n', ":2:"), ('{"output_len": 3}\n', ":1:"),
                       ("\n", "no prompts")):  # fmt: skip
        path.write_text(bad)
        with pytest.raises(InvalidRequestError) as refused:
            jsonl_requests(path, output_len=4, limit=None)
        assert refused.value.field == "dataset" and where in refused.value.message


def test_arrivals_all_at_once_poisson_or_bursty_at_the_same_mean_rate() -> None:
    assert list(arrival_gaps(5, math.inf, 1.0, seed=0)) == [0.0] * 5
    poisson = np.array(list(arrival_gaps(20000, 4.0, 1.0, seed=1)))
    bursty = np.array(list(arrival_gaps(20000, 4.0, 0.25, seed=1)))
    for gaps in (poisson, bursty):
        assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    # Exponential gaps have a coefficient of variation of 1; gamma of shape k, 1/sqrt(k).
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.05)
    for field, args in (("request_rate", (0.0, 1.0)), ("burstiness", (1.0, 0.0))):
        with pytest.raises(InvalidRequestError) as refused:
            list(arrival_gaps(1, *args, seed=0))
        assert refused.value.field == field


def test_figures_follow_the_definitions() -> None:
    # Sent at 0: chunks at 0.1 (1 token), 0.3 (2 tokens), 0.4 (1 token): 4 tokens.
    first = RequestRecord(sent_at=0.0, chunk_times=[0.1, 0.3, 0.4], output_tokens=4,
                          prompt_tokens=10, cached_tokens=0)  # fmt: skip
    # Sent at 0.2: one chunk at 0.5 with 1 token: no TPOT, no ITL.
    second = RequestRecord(sent_at=0.2, chunk_times=[0.5], output_tokens=1, prompt_tokens=6,
                           cached_tokens=4)  # fmt: skip
    failed = RequestRecord(sent_at=0.3, error="UNAVAILABLE: gone")
    # The run lasted 0.5 s: its start to the end of its last request (the failed one's too).
    summary = summarize([first, second, failed], duration=0.5)
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["duration_s"] == 0.5
    assert summary["total_output_tokens"] == 5 and summary["total_input_tokens"] == 16
    assert summary["cached_input_tokens"] == 4
    assert summary["request_throughput"] == pytest.approx(4.0)
    assert summary["output_throughput"] == pytest.approx(10.0)
    assert summary["total_token_throughput"] == pytest.approx(42.0)
    assert summary["mean_ttft_ms"] == pytest.approx(200.0)  # 100 and 300
    assert summary["median_ttft_ms"] == pytest.approx(200.0)
    assert summary["mean_tpot_ms"] == pytest.approx(100.0)  # (400 - 100) / 3, one request
    assert summary["mean_itl_ms"] == pytest.approx(150.0)  # 200 and 100
    assert summary["p99_e2el_ms"] == pytest.approx(400.0 - 0.01 * 100.0)
    assert "Mean TTFT (ms):" in format_table(summary, "t")
    assert summarize([failed], duration=0.1) == {"completed": 0, "failed": 1}


def test_bf16_arithmetic_follows_the_cpu_flags_and_the_isa_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine_svc.bench import machine

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(machine, "cpu_flags", lambda: ["avx2", "fma", "avx512f", "avx512_bf16"])
    assert machine.has_bf16_arithmetic()
    monkeypatch.setattr(machine, "cpu_flags", lambda: ["avx2", "fma"])
    assert not machine.has_bf16_arithmetic()
    monkeypatch.setattr(machine, "cpu_flags", lambda: ["avx2", "amx_tile", "amx_bf16"])
    assert machine.has_bf16_arithmetic()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # `--isa avx2`
    assert not machine.has_bf16_arithmetic()


def test_the_avx2_cap_builds_our_kernels_again_only_where_the_cpu_has_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On AVX-512 the cap loads the x86-64-v3 build; on an AVX2-only CPU the native build is
    the AVX2 code, and the torch, MKL and oneDNN caps are all the run needs."""
    from engine_svc.bench import machine

    monkeypatch.setattr(machine, "cpu_flags", lambda: ["avx2", "fma", "avx512f"])
    assert machine.isa_caps("avx2") == machine.ISA_CAPS["avx2"]
    assert machine.capped_kernel_level("avx2") == "x86-64-v3"
    monkeypatch.setattr(machine, "cpu_flags", lambda: ["avx2", "fma"])
    caps = machine.isa_caps("avx2")
    assert caps == {**machine.ISA_CAPS["avx2"], "DUOSERVE_CPU_ARCH": "native"}
    assert machine.capped_kernel_level("avx2") == "native"


def test_the_machine_line_names_the_fast_paths_of_the_dtype_measured() -> None:
    from engine_svc.bench import machine
    from engine_svc.kernels import packed_linear_available
    from engine_svc.kernels.loader import describe

    for dtype in (torch.float32, torch.bfloat16):
        lines = machine.describe(dtype).splitlines()
        assert lines[0].startswith(f"machine: {machine.cpu_model()}")
        assert lines[1] == describe(dtype, 64)
        # The packed kernel serves bfloat16 only where torch's bfloat16 matmul is scalar.
        assert ("packed projections" in lines[1]) == packed_linear_available(dtype)


def test_the_gemm_ceiling_is_the_fastest_gemm_the_process_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's matmul is timed first, then the engine's own path for the dtype where it has
    one (float32's packed kernel on a fast build); each here "takes" half the time of the
    one before, so the last is the ceiling, and two measurements keep the faster's name."""
    from engine_svc.bench import ceiling
    from engine_svc.kernels import packed_linear_available

    seconds = iter([2.0, 1.0, 0.5])
    monkeypatch.setattr(ceiling, "_best_seconds", lambda gemm: (gemm(), next(seconds))[1])
    name, flops = ceiling.measure_gemm_flops(torch.float32, size=64)
    own = packed_linear_available(torch.float32)
    assert (name, flops) == (("packed", 2 * 64**3) if own else ("torch", 64**3))
    slow = ceiling.Ceilings(1.0, 5.0, "torch", "read")
    fast = ceiling.Ceilings(2.0, 4.0, "packed", "copy")
    assert slow.best(fast) == fast.best(slow) == ceiling.Ceilings(2.0, 5.0, "packed", "read")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_memory_ceiling_is_the_fastest_stream_the_process_has(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """A copy (read and write bytes), a read, then the engine's one-row projection where a
    kernel serves the dtype; each here "takes" a quarter, then half, of the time of the one
    before (the copy's bytes count twice: read and written), and each stream really runs."""
    from engine_svc.bench import ceiling
    from engine_svc.kernels.loader import (
        bf16_pairs_available,
        one_row_copy_available,
        packed_linear_available,
        row_gemv_available,
    )

    seconds = iter([1.0, 0.25, 0.125])
    monkeypatch.setattr(ceiling, "_best_seconds", lambda run: (run(), next(seconds))[1])
    name, rate = ceiling.measure_memory_bandwidth(dtype, num_bytes=1 << 20)
    if packed_linear_available(dtype):
        assert (name, rate) == ("packed", 8 << 20)
    elif bf16_pairs_available(dtype):
        assert (name, rate) == ("pairs", 8 << 20)
    elif row_gemv_available(dtype) or one_row_copy_available(dtype):
        assert (name, rate) == ("row_gemv", 8 << 20)
    else:
        assert (name, rate) == ("read", 4 << 20)


def test_offline_device_options_are_checked_where_they_are_read(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from engine_svc.bench.offline import parse_args

    assert parse_args(["--model", "m", "--device", "cpu"]).device == "cpu"
    bad = [["--device", "tpu:0"], ["--gpu-memory-utilization", "0"]]
    if not torch.cuda.is_available():
        bad.append(["--device", "cuda"])
    for options in bad:
        with pytest.raises(SystemExit) as exited:
            parse_args(["--model", "m", *options])
        assert exited.value.code == 2
        assert options[0] in capsys.readouterr().err


def test_serve_against_offline_splits_one_gpu_between_engine_and_offline_worker() -> None:
    from engine_svc.bench.serve import _engine_flag, _offline_memory_share, parse_args

    def options(*engine_args: str) -> list[str]:
        return ["--model", "m", "--against-offline", *(f"--engine-arg={a}" for a in engine_args)]

    # Both forms of a flag are read.
    args = parse_args(options("--device", "cuda:1", "--gpu-memory-utilization=0.3"))
    assert _engine_flag(args, "--device") == "cuda:1"
    assert _engine_flag(args, "--gpu-memory-utilization") == "0.3"
    assert _offline_memory_share(args) == 0.45  # 0.3 + 0.45 fits under 0.9
    assert _offline_memory_share(
        parse_args(options("--device=cuda", "--gpu-memory-utilization", "0.8"))
    ) == pytest.approx(0.1)
    # The engine started here gets the same share unless told otherwise.
    args = parse_args(options("--device=cuda"))
    assert _offline_memory_share(args) == 0.45
    assert "--gpu-memory-utilization=0.45" in args.engine_arg
    with pytest.raises(InvalidRequestError, match=r"gpu-memory-utilization=0\.88"):
        _offline_memory_share(parse_args(options("--device=cuda", "--gpu-memory-utilization=0.88")))
    # On CPU the host's budget applies: no share.
    args = parse_args(options("--device=cpu"))
    assert _offline_memory_share(args) is None and args.engine_arg == ["--device=cpu"]
