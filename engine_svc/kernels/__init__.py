"""CPU kernels in C++, built on this machine the first time they are needed.

`paged_decode_attention` reads the paged KV cache directly; `torch.ops.duoserve.rms_norm`,
`add_rms_norm` and `rotary_inplace` fuse a layer's elementwise work; `packed_linear` runs a
projection over weights packed once by `pack_linear_weight`, and `prefill_attention_` the
causal attention of a step's prompt chunks (float32 or bfloat16; `packed_linear` also takes bfloat16
weights, multiplied in float32, for CPUs where torch's bfloat16 matmul is scalar; where it is
oneDNN's, bfloat16 projections keep oneDNN's prepacked weights on AMX machines, run
`bf16_pairs_linear` over weights packed in pairs of k by `pack_bf16_pairs` on AVX512-BF16 ones,
and elsewhere `row_gemv` takes their single rows); `argmax_rows` and `sample_rows` draw the
sampler's tokens, greedy and random. All live in
engine_svc/kernels/csrc and are used by the layers (engine_svc/layers) when the model runner
turns them on. The build (engine_svc/kernels/build.py, `-march=native`) happens the first time
they are needed, cached under ~/.cache/duoserve/kernels, one folder per CPU-feature set, so a
later start only loads the library; `make kernels` builds it ahead, and DUOSERVE_CPU_ARCH
names portable levels to build instead ("x86-64-v4,x86-64-v3": each machine loads the best
it runs). Where it cannot build (no compiler), or with
DUOSERVE_CPU_KERNELS=0, the model takes the plain-torch path, which gives the same results
to float rounding.
"""

from engine_svc.kernels.loader import (
    bf16_pairs_available,
    cpu_kernels_available,
    describe,
    one_row_copy_available,
    onednn_linear_available,
    packed_block_size,
    packed_linear_available,
    paged_decode_attention,
    prefill_attention_available,
    row_gemv_available,
    torch_bf16_matmul_is_scalar,
)

__all__ = [
    "bf16_pairs_available",
    "cpu_kernels_available",
    "describe",
    "one_row_copy_available",
    "onednn_linear_available",
    "packed_block_size",
    "packed_linear_available",
    "paged_decode_attention",
    "prefill_attention_available",
    "row_gemv_available",
    "torch_bf16_matmul_is_scalar",
]
