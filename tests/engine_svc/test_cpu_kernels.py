"""The C++ CPU kernels against the plain-torch paths they replace, to float rounding: decode
attention over block sizes, GQA groups, head sizes, dtypes and context lengths (1, exact
block multiples, ragged), for one sequence (a task per KV head) and many (a task per
sequence); the fused RMSNorm, rotary and silu * up; prefill attention against SDPA per
chunk; both under sliding windows. (packed_linear: test_packed_linear.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine_svc.kernels import cpu_kernels_available, paged_decode_attention
from engine_svc.kernels.loader import _cpu_flags, describe, loaded_build
from engine_svc.layers.attention import AttentionMetadata, _decode_attention


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    # make test builds them (make install); a machine without a compiler fails here, loudly.
    assert cpu_kernels_available(), "the CPU kernels did not build: see the warning logged"


def _case(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    context_lens: list[int],
    dtype: torch.dtype,
    seed: int = 0,
    head_dim: int = 64,
) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in context_lens)
    num_blocks = num_seqs * width + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    # Blocks scattered over the pool, in no order, as a long-running cache has them.
    order = torch.randperm(num_blocks, generator=generator)[: num_seqs * width]
    tables = order.view(num_seqs, width).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    # q as the model has it: a view into a wider fused qkv row.
    qkv = torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    q = qkv.to(dtype)[:, : num_heads * head_dim].view(num_seqs, num_heads, head_dim)
    return q, k_cache, v_cache, tables, lens


def _reference(
    inputs: tuple[torch.Tensor, ...], scale: float, window: int | None = None
) -> torch.Tensor:
    """The plain-torch decode path: gather the blocks, mask the padding (and the keys before
    a sliding window, built here rather than by the path under test), SDPA."""
    q, k_cache, v_cache, tables, lens = inputs
    keys = torch.arange(tables.shape[1] * k_cache.shape[1]).unsqueeze(0)
    visible = keys < lens.unsqueeze(1).long()
    if window is not None:
        visible &= keys >= lens.unsqueeze(1).long() - window
    visible = visible.view(len(lens), 1, 1, -1)
    mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), tables.long(), mask, [])
    return _decode_attention(q, k_cache, v_cache, meta, scale, None)


def _flash_rounded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """bfloat16 attention as torch's flash attention (Hugging Face's SDPA) computes it, which
    the kernels follow: float32 scores and softmax numerators exp(s - max), the numerators
    rounded to bfloat16 for P V, 1 / sum of the unrounded ones applied after, one rounding
    at the end. q: [heads, queries, d]; k, v: [heads, keys, d] (KV heads repeated);
    visible: [queries, keys] or broadcastable."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    numerators = torch.exp(scores - scores.amax(-1, keepdim=True))
    weighted = numerators.bfloat16().float() @ v.float()
    return (weighted * (1 / numerators.sum(-1, keepdim=True))).bfloat16()


def _bf16_reference(inputs: tuple[torch.Tensor, ...], scale: float) -> torch.Tensor:
    """_flash_rounded over each sequence's cached context: the bfloat16 decode kernel's
    reference."""
    q, k_cache, v_cache, tables, lens = inputs
    group = q.shape[1] // k_cache.shape[2]
    out = []
    for row, length in enumerate(lens.tolist()):
        slots = (
            tables[row].long().unsqueeze(1) * k_cache.shape[1] + torch.arange(k_cache.shape[1])
        ).flatten()[:length]
        keys = k_cache.flatten(0, 1)[slots].transpose(0, 1).repeat_interleave(group, 0)
        values = v_cache.flatten(0, 1)[slots].transpose(0, 1).repeat_interleave(group, 0)
        visible = torch.ones(1, length, dtype=torch.bool)
        out.append(_flash_rounded(q[row].unsqueeze(1), keys, values, visible, scale)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_size", "context_lens"),
    [
        (9, 3, 16, [1, 16, 17, 200, 333]),  # SmolLM2's shape; 1, a block, a block + 1
        (8, 8, 8, [5, 64, 100]),  # no GQA
        (8, 2, 32, [31, 32, 33, 500]),
        (4, 1, 128, [1, 129, 700]),  # multi-query
    ],
)
def test_kernel_matches_torch_float32(
    num_heads: int, num_kv_heads: int, block_size: int, context_lens: list[int]
) -> None:
    inputs = _case(
        len(context_lens), num_heads, num_kv_heads, block_size, context_lens, torch.float32
    )
    got = paged_decode_attention(*inputs, max(context_lens), 0.125)
    torch.testing.assert_close(got, _reference(inputs, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [128, 80])  # 80: no vectorized path, the generic one
def test_kernel_matches_torch_for_other_head_dims(head_dim: int) -> None:
    lens = [1, 17, 100, 250]
    inputs = _case(len(lens), 8, 2, 16, lens, torch.float32, seed=2, head_dim=head_dim)
    got = paged_decode_attention(*inputs, max(lens), 0.1)
    torch.testing.assert_close(got, _reference(inputs, 0.1), rtol=1e-5, atol=1e-5)


def test_kernel_matches_torch_for_many_sequences() -> None:
    """Enough sequences that each task takes a whole sequence, every KV head."""
    lens = torch.randint(1, 300, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    inputs = _case(64, 9, 3, 16, lens, torch.float32, seed=3)
    got = paged_decode_attention(*inputs, max(lens), 0.125)
    torch.testing.assert_close(got, _reference(inputs, 0.125), rtol=1e-5, atol=1e-5)


@pytest.fixture
def two_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("two_threads")
def test_loading_a_sequences_rows_first_changes_no_bits(dtype: torch.dtype) -> None:
    """With 8 or more sequences on 2 threads each task takes a whole sequence: it loads the
    sequence's rows into cache before its passes where they fit in twice the L2 (the short
    ones) and prefetches them as it goes where not (the long one, sized from the L2 the C
    library reports); a sequence alone takes one task per KV head, which prefetches. Each
    sequence's output is the same bits either way."""
    # The L2 as the kernel reads it: glibc's sysconf, which Python does not expose.
    reported = subprocess.run(
        ["getconf", "LEVEL2_CACHE_SIZE"], capture_output=True, text=True, check=False
    ).stdout.strip()
    l2_bytes = int(reported) if reported.isdigit() and int(reported) > 0 else 512 << 10
    row_bytes = 2 * 3 * 64 * torch.tensor([], dtype=dtype).element_size()  # K and V, a token
    long_len = 2 * l2_bytes // row_bytes + 16
    short = torch.randint(1, 300, (15,), generator=torch.Generator().manual_seed(4)).tolist()
    lens = [long_len, *short]
    q, k_cache, v_cache, tables, context_lens = _case(16, 9, 3, 16, lens, dtype, seed=4)
    together = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, max(lens), 0.125)
    for s, length in enumerate(lens):
        one = slice(s, s + 1)
        alone = paged_decode_attention(
            q[one], k_cache, v_cache, tables[one], context_lens[one], length, 0.125
        )
        assert torch.equal(together[one], alone), f"sequence {s} ({length} tokens)"


# bfloat16 at head_dim 64 and 128 takes the vector path, widening the cache's rows as it
# reads them; at 80, and float16 at any size, the generic loop. 64 sequences: each task
# reads whole cache rows (every KV head).
@pytest.mark.parametrize(
    ("dtype", "head_dim", "num_seqs"),
    [
        (torch.bfloat16, 64, 3),
        (torch.bfloat16, 128, 3),
        (torch.bfloat16, 80, 3),
        (torch.bfloat16, 64, 64),
        (torch.float16, 64, 3),
    ],
)
def test_kernel_matches_torch_half_precision(
    dtype: torch.dtype, head_dim: int, num_seqs: int
) -> None:
    generator = torch.Generator().manual_seed(num_seqs)
    lens = (
        [1, 40, 250]
        if num_seqs == 3
        else torch.randint(1, 300, (num_seqs,), generator=generator).tolist()
    )
    inputs = _case(num_seqs, 9, 3, 16, lens, dtype, seed=1, head_dim=head_dim)
    got = paged_decode_attention(*inputs, max(lens), 0.125)
    # The kernel accumulates in float32: compare with the float32 reference on the same values.
    as_float = tuple(t.float() if t.is_floating_point() else t for t in inputs)
    expected = _reference(as_float, 0.125)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
    if dtype == torch.bfloat16 and head_dim != 80:  # the vector path rounds as flash does
        assert (got == _bf16_reference(inputs, 0.125)).double().mean().item() > 0.99


def test_bfloat16_scores_take_dot_products_where_the_build_has_them() -> None:
    """AVX512-BF16's vdpbf16ps in a native AVX-512 build on a CPU that has it (the tests
    above then check its scores); widened float32 everywhere else."""
    build = loaded_build()
    assert build is not None
    expected = (
        build.level == "native" and build.capability == "avx512" and "avx512_bf16" in _cpu_flags()
    )
    assert build.bf16_dot_products == expected
    assert ("bfloat16 dot products" in describe(torch.bfloat16, 64)) == expected
    assert "dot products" not in describe(torch.float32, 64)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (10, 2)])
def test_bfloat16_kernel_for_every_group_size(heads: int, kv_heads: int) -> None:
    """Query heads a KV head serves: 1 (each key row read by one head), and 5 (a pass of
    4 heads, whose bfloat16 key rows are widened once for all four, then 1)."""
    lens = [1, 17, 40, 250]
    inputs = _case(4, heads, kv_heads, 16, lens, torch.bfloat16, seed=2)
    got = paged_decode_attention(*inputs, max(lens), 0.125)
    as_float = tuple(t.float() if t.is_floating_point() else t for t in inputs)
    torch.testing.assert_close(got.float(), _reference(as_float, 0.125), rtol=1e-2, atol=1e-2)
    assert (got == _bf16_reference(inputs, 0.125)).double().mean().item() > 0.99


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(8, 1, 64), (16, 2, 64), (12, 3, 64), (8, 2, 128)]
)
def test_bfloat16_heads_beyond_one_pass_share_each_chunk_of_rows(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    """More query heads on a KV head than one pass holds in registers (where the build has
    no bfloat16 dot products: each chunk of rows serves every group of heads in turn, the
    sums kept between chunks): the same values as torch, on lengths that end mid-chunk."""
    lens = [1, 15, 17, 40, 250]
    inputs = _case(len(lens), heads, kv_heads, 16, lens, torch.bfloat16, seed=7, head_dim=head_dim)
    scale = head_dim**-0.5
    got = paged_decode_attention(*inputs, max(lens), scale)
    as_float = tuple(t.float() if t.is_floating_point() else t for t in inputs)
    torch.testing.assert_close(got.float(), _reference(as_float, scale), rtol=1e-2, atol=1e-2)
    assert (got == _bf16_reference(inputs, scale)).double().mean().item() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "window"), [(5, 0), (7, 0), (5, 12), (7, 30), (16, 9)])
def test_rows_are_found_for_any_block_size_and_window_start(
    block_size: int, window: int, dtype: torch.dtype
) -> None:
    """Each sequence's rows are located once through its block table: blocks of any size,
    and a window whose first token lies inside a block."""
    lens = [1, 5, 6, 13, 34, 101]
    inputs = _case(len(lens), 9, 3, block_size, lens, dtype, seed=8)
    as_float = tuple(t.float() if t.is_floating_point() else t for t in inputs)
    got = paged_decode_attention(*inputs, max(lens), 0.125, window)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    expected = _reference(as_float, 0.125, window or None)
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 16, 40, 1000])
def test_a_sliding_window_reads_only_its_last_tokens(window: int, dtype: torch.dtype) -> None:
    """Each query attends to its last `window` tokens; the blocks wholly before them may
    have been released and reused, so the kernel must not read them: here they hold NaN."""
    lens = [1, 16, 17, 40, 41, 200]
    inputs = _case(len(lens), 8, 2, 16, lens, dtype, seed=4)
    _, k_cache, v_cache, tables, context_lens = inputs
    expected = _reference(tuple(t.float() if t.is_floating_point() else t for t in inputs),
                          0.125, window)  # fmt: skip
    for row, length in enumerate(lens):
        released = tables[row, : max(0, length - window) // 16].long()
        k_cache[released] = float("nan")
        v_cache[released] = float("nan")
    got = paged_decode_attention(*inputs, max(lens), 0.125, window)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
    # The torch path's own window mask (AttentionMetadata.decode_mask_for), on clean blocks.
    if dtype == torch.float32:
        clean = _case(len(lens), 8, 2, 16, lens, dtype, seed=4)
        keys = torch.arange(tables.shape[1] * 16)
        padding = (keys.unsqueeze(0) < context_lens.unsqueeze(1).long()).view(len(lens), 1, 1, -1)
        mask = torch.zeros(padding.shape).masked_fill_(~padding, float("-inf"))
        meta = AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), tables.long(),
                                 mask, [], decode_context_lens=context_lens.long())  # fmt: skip
        torch_path = _decode_attention(clean[0], clean[1], clean[2], meta, 0.125, window)
        torch.testing.assert_close(torch_path, expected, rtol=1e-5, atol=1e-5)


def test_kernel_rejects_bad_inputs_with_an_error() -> None:
    q, k_cache, v_cache, tables, lens = _case(2, 9, 3, 16, [5, 20], torch.float32)
    with pytest.raises(RuntimeError, match="block_tables"):
        paged_decode_attention(q, k_cache, v_cache, tables.long(), lens, 20, 0.125)
    with pytest.raises(RuntimeError, match="context_lens"):
        paged_decode_attention(
            q, k_cache, v_cache, tables, torch.tensor([5, 999], dtype=torch.int32), 20, 0.125
        )
    with pytest.raises(RuntimeError, match="dtype"):
        paged_decode_attention(q.double(), k_cache, v_cache, tables, lens, 20, 0.125)


# ---- fused RMSNorm and rotary --------------------------------------------------------------


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _assert_rms_norm_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The squares summed in torch's order, then torch's operations and roundings: the
    same bits."""
    bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits), expected.view(bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Whole groups of 8 and a partial last one; under 8 values; 2,048 and 8,192: the sum's
# cascade moves its running sums up one level, and two.
@pytest.mark.parametrize("width", [576, 80, 333, 7, 2048, 8192])
def test_rms_norm_and_the_residual_add_match_torch(dtype: torch.dtype, width: int) -> None:
    generator = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(37, width, generator=generator)).to(dtype)
    residual = torch.randn(37, width, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=generator)).to(dtype)
    normed = torch.ops.duoserve.rms_norm(x, weight, 1e-5)
    _assert_rms_norm_close(normed, _torch_rms_norm(x, weight, 1e-5))
    summed, normed = torch.ops.duoserve.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, residual + x)  # the residual stream: bit for bit
    _assert_rms_norm_close(normed, _torch_rms_norm(residual + x, weight, 1e-5))


@pytest.mark.parametrize("head_dim", [64, 40])  # 40: half a head ends mid-vector
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_is_bit_identical_to_torch(dtype: torch.dtype, head_dim: int) -> None:
    from engine_svc.layers.rotary import RotaryEmbedding, apply_rotary

    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None)
    positions = torch.tensor([0, 1, 7, 100, 511, 3])
    generator = torch.Generator().manual_seed(6)
    qkv = torch.randn(6, (9 + 3 + 3) * head_dim, generator=generator).to(dtype)
    q = qkv[:, : 9 * head_dim].view(6, 9, head_dim)  # a strided view, as the model has it
    kv_before = qkv[:, 9 * head_dim :].clone()
    cos, sin = rotary.cos_sin(positions, dtype)
    expected = apply_rotary(q, cos, sin)
    rows_cos, rows_sin = rotary.cos_sin_rows(positions)
    torch.ops.duoserve.rotary_inplace(q, rows_cos, rows_sin)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # signed zeros too
    assert torch.equal(q.view(bits), expected.view(bits))
    assert torch.equal(qkv[:, 9 * head_dim :], kv_before)  # K and V untouched


def test_without_a_compiler_the_engine_falls_back_with_a_warning(tmp_path: Path) -> None:
    """No build cached and no working compiler: a warning and False, never a crash."""
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING);"
        "from engine_svc.kernels import cpu_kernels_available;"
        "print('available:', cpu_kernels_available())"
    )
    env = {**os.environ, "DUOSERVE_KERNEL_CACHE": str(tmp_path), "CXX": "/nonexistent/c++"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "available: False"
    assert "CPU kernels unavailable, the model runs in plain torch" in done.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 7 and 100: a partial vector at the end; 24 and 48: a whole one after the pairs of vectors
@pytest.mark.parametrize("width", [1536, 100, 64, 48, 24, 7])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, width: int) -> None:
    generator = torch.Generator().manual_seed(5)
    # The fused gate_up output, rows of a wider buffer; values out to where exp saturates.
    wide = torch.randn(33, 2 * width + 3, generator=generator) * 30
    gate_up = wide.to(dtype)[:, : 2 * width]
    got = torch.ops.duoserve.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert got.dtype == dtype and got.shape == (33, width)
    build = loaded_build()
    if width % 32 == 0 and build is not None and build.fast:
        # torch's silu (its vectorized exp, Sleef's, and the same division), rounded where
        # torch's ops round: the same bits, -0 included, where torch's loop runs vectors all
        # along (it takes two at a time; a remainder goes through the scalar std::exp, as
        # the plain-C++ build's vectors do).
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(bits), expected.contiguous().view(bits))
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def test_bf16_silu_and_mul_is_torch_s_for_every_gate_value() -> None:
    """bfloat16 silu(gate) is a lookup by the gate's bits (vec_silu.h's silu_bf16_table): all
    65,536 gates, NaNs and infinities included, against torch's silu then mul."""
    gate = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = (torch.randn(1 << 16, generator=torch.Generator().manual_seed(3)) * 4).to(gate.dtype)
    got = torch.ops.duoserve.silu_and_mul(torch.cat([gate, up]).view(1, -1))[0]
    expected = torch.nn.functional.silu(gate) * up
    both_nan = got.isnan() & expected.isnan()
    build = loaded_build()
    if build is not None and build.fast:
        same = (got.view(torch.int16) == expected.view(torch.int16)) | both_nan
        assert bool(same.all()), gate[~same][:8]
    finite = expected.isfinite()
    assert torch.equal(got.isnan(), expected.isnan())
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-2, atol=1e-2)


# ---- prefill attention ----------------------------------------------------------------------


def _sdpa_per_chunk(
    q, k, v, starts: list[int], lens: list[int], scale: float, window: int | None = None
) -> torch.Tensor:
    out = torch.zeros_like(q)
    for start, length in zip(starts, lens, strict=True):
        rows = slice(start, start + length)
        mask = None
        if window is not None:  # query i attends to keys (i - window, i]
            position = torch.arange(length)
            offset = position.unsqueeze(1) - position.unsqueeze(0)
            mask = (offset >= 0) & (offset < window)
        attended = torch.nn.functional.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),
            k[rows].transpose(0, 1).unsqueeze(0),
            v[rows].transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = attended[0].transpose(0, 1)
    return out


def _flash_rounded_per_chunk(
    q, k, v, starts: list[int], lens: list[int], scale: float, window: int | None = None
) -> torch.Tensor:
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    for start, length in zip(starts, lens, strict=True):
        rows = slice(start, start + length)
        offset = torch.arange(length).unsqueeze(1) - torch.arange(length).unsqueeze(0)
        visible = (offset >= 0) & (offset < (window or length))
        keys = k[rows].transpose(0, 1).repeat_interleave(group, 0)
        values = v[rows].transpose(0, 1).repeat_interleave(group, 0)
        attended = _flash_rounded(q[rows].transpose(0, 1), keys, values, visible, scale)
        out[rows] = attended.transpose(0, 1)
    return out


def test_bfloat16_attention_rounds_as_torch_flash_attention() -> None:
    """Hugging Face's bfloat16 baseline attends through torch's flash kernel: both kernels
    follow its roundings (_flash_rounded), so most outputs equal it bit for bit; attending
    in float32 and rounding once left a third of them one bfloat16 step apart."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    generator = torch.Generator().manual_seed(11)
    length, heads, kv_heads, dim = 150, 9, 3, 64
    q, k, v = (torch.randn(length, n, dim, generator=generator).bfloat16()
               for n in (heads, kv_heads, kv_heads))  # fmt: skip
    spans = (torch.tensor([0], dtype=torch.int32), torch.tensor([length], dtype=torch.int32))
    ours = torch.zeros_like(q)
    torch.ops.duoserve.prefill_attention_(ours, q, k, v, *spans, 0.125, 0)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # 4-D, as Hugging Face calls it
        flash = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=0.125, enable_gqa=True,
        )[0].transpose(0, 1)  # fmt: skip
    assert (ours == flash).double().mean().item() > 0.85
    # Decode: the last token of the prompt, from a paged cache holding the prompt's K/V.
    k_cache, v_cache = k.view(-1, 10, kv_heads, dim), v.view(-1, 10, kv_heads, dim)
    table = torch.arange(length // 10, dtype=torch.int32).unsqueeze(0)
    lens = torch.tensor([length], dtype=torch.int32)
    decoded = paged_decode_attention(q[-1:], k_cache, v_cache, table, lens, length, 0.125)
    assert (decoded == flash[-1:]).double().mean().item() > 0.85


_PREFILL_SHAPES = [
    (9, 3, 64, None), (8, 8, 64, None), (4, 1, 128, None), (9, 3, 64, 1), (8, 2, 64, 50),
    (8, 2, 128, 64), (9, 3, 64, 1000),
]  # fmt: skip


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "window", "dtype"),
    [(*shape, torch.float32) for shape in _PREFILL_SHAPES]
    + [(*shape, torch.bfloat16) for shape in _PREFILL_SHAPES[:2] + _PREFILL_SHAPES[4:6]],
)
def test_prefill_kernel_matches_sdpa_per_chunk(
    num_heads: int, num_kv_heads: int, head_dim: int, window: int | None, dtype: torch.dtype
) -> None:
    # One token, a 64-row task and one row either side, several tasks; after a gap of
    # tokens that belong to no chunk (decodes, chunks with context).
    lens = [1, 2, 63, 64, 65, 200, 300]
    starts = [5 + sum(lens[:i]) for i in range(len(lens))]
    tokens = starts[-1] + lens[-1] + 3
    generator = torch.Generator().manual_seed(7)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=generator).to(dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(tokens, num_kv_heads, head_dim)
    out = torch.zeros(tokens, num_heads, head_dim, dtype=dtype)
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    spans = (as_int32(starts), as_int32(lens))
    torch.ops.duoserve.prefill_attention_(out, q, k, v, *spans, 0.11, window or 0)
    expected = _sdpa_per_chunk(q.float(), k.float(), v.float(), starts, lens, 0.11, window)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:  # rounded as flash attention rounds: equal to that but at ties
        torch.testing.assert_close(out.float(), expected, rtol=2**-6, atol=2**-6)
        rounded = _flash_rounded_per_chunk(q, k, v, starts, lens, 0.11, window)
        assert (out[5:-3] == rounded[5:-3]).double().mean().item() > 0.99
    assert not out[:5].any() and not out[-3:].any()  # rows of no chunk stay untouched


def test_prefill_kernel_rejects_bad_inputs_with_an_error() -> None:
    q, k = torch.randn(10, 9, 64), torch.randn(10, 3, 64)
    out = torch.empty_like(q)
    ok = torch.tensor([0], dtype=torch.int32)
    cases = [
        ((out, q, k, k, ok, torch.tensor([11], dtype=torch.int32)), "out of range"),
        ((out, q, k, k, ok.long(), ok + 10), "int32"),
        ((out, q.double(), k, k, ok, ok + 10), "float32 or all bfloat16"),
        ((out, q.bfloat16(), k, k, ok, ok + 10), "float32 or all bfloat16"),
        ((out[..., :40], q[..., :40], k[..., :40], k[..., :40], ok, ok + 10), r"multiple of \d+"),
    ]
    for args, words in cases:
        with pytest.raises(RuntimeError, match=words):
            torch.ops.duoserve.prefill_attention_(*args, 0.125)
