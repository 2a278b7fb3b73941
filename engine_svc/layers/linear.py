"""Linear projections in the layout each backend reads fastest.

After loading, every projection's weight is stored transposed, [in, out]: on CPU, MKL's
GEMM then skips transposing the weight while packing it at every call (decode's skinny
matmuls ran 1.4x faster), with bit-identical results. With the C++ CPU kernels on, float32
projections go further: their weights are packed once into the blocks a GEMM micro-kernel
reads (`Projection.pack`); bfloat16 ones are packed once in pairs of k for AVX512-BF16's dot
products, and AMX's tiles where the CPU has them (`Projection.use_bf16_pairs`), on CPUs with
AVX512-BF16, or, where torch's bfloat16 matmul is oneDNN's otherwise, reordered once into
oneDNN's own blocked layout (`Projection.use_onednn`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.kernels import packed_block_size


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """An [out, in] weight as a contiguous [in, out] tensor, for `matmul`."""
    return weight.detach().t().contiguous()


def matmul(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight_t (+ bias), weight_t being [in, out]: F.linear with a transposed weight."""
    if bias is None:
        return x @ weight_t
    return torch.addmm(bias, x, weight_t)


# Projection.forward's main paths, numbered as the C++ decode loop's Path enum
# (engine_svc/kernels/csrc/decode_layers.cpp) numbers them.
ONEDNN_PATH, PACKED_PATH, MATMUL_PATH, LINEAR_PATH, PAIRS_PATH = 1, 2, 3, 4, 5
# An MLP's gate/up on pairs that compute silu(gate) * up (Projection.silu_pairs).
PAIRS_SILU_PATH = 6

# A projection holding both bfloat16 layouts sends steps of at most this many rows through
# the pairs kernel and more (prompt steps) through oneDNN's prepacked weights. On the Zen 5,
# with the weights streaming: the pairs kernel 19.4 ms at 64 rows for SmolLM2-135M's
# projections against oneDNN's 23.9, 73.7 at 256 against 75-77; in the engine, a batch's
# 2,048-token prompt steps ran 15% slower on pairs alone (2.83-3.02 s against 2.36-2.63). On
# the Xeon with AMX the pairs were still the faster at 512 rows (92-95 ms against 106) and
# oneDNN at 2,048 (334-348 against 426-454).
PAIRS_MAX_ROWS = 256


class Projection(nn.Module):
    """A linear layer without nn.Linear's init cost, in one of three weight layouts:
    `weight`, Hugging Face's [out, in], for loading (and kept where it is tied to the
    embeddings); `weight_t`, [in, out], for torch's matmul, set by `transpose()`; and
    `weight_packed`, column blocks for the C++ kernel (engine_svc/kernels/csrc/
    packed_linear.cpp), set by `pack()`, `weight_pairs`, pairs of k for AVX512-BF16's dot
    products and AMX's tiles (kernels/csrc/bf16_pairs_linear.cpp), set by
    `use_bf16_pairs()`, or
    `weight_onednn`, oneDNN's opaque blocked layout, set by `use_onednn()`; each replaces the
    others (but a `shared_weight`, tied to the
    embeddings, stays). The model chooses a layout once, at load time."""

    weight_t: torch.Tensor | None
    weight_packed: torch.Tensor | None
    weight_onednn: torch.Tensor | None
    weight_pairs: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.shared_weight = False
        self.row_gemv = False
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("weight_t", None, persistent=False)
        self.register_buffer("weight_packed", None, persistent=False)
        self.register_buffer("weight_onednn", None, persistent=False)
        self.register_buffer("weight_pairs", None, persistent=False)
        self.silu_pairs = False

    @classmethod
    def fused(cls, parts: list[Projection]) -> Projection:
        """One projection computing `parts` side by side (q/k/v, gate/up), transposed."""
        fused = cls(parts[0].weight.shape[1], sum(p.out_features for p in parts), False)
        fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]))
        if parts[0].bias is not None:
            fused.bias = nn.Parameter(
                torch.cat([p.bias.detach() for p in parts if p.bias is not None])
            )
        fused.transpose()
        return fused

    def transpose(self) -> None:
        self.weight_t = transposed(self.weight)
        del self.weight

    def pack(self) -> None:
        if self.weight_packed is not None:
            return
        source = self._out_in_weight()
        block = packed_block_size(self.out_features)
        self.weight_packed = torch.ops.duoserve.pack_linear_weight(source.contiguous(), block)
        self._drop_plain_weights()

    def use_bf16_pairs(self, onednn_copy: bool = False, silu_halves: bool = False) -> None:
        """bfloat16 on AVX512-BF16: the weight packed once in pairs of k, which
        `bf16_pairs_linear` multiplies with vdpbf16ps, fetching each panel's successor while
        it computes (oneDNN's kernel waited on each streaming panel), and with AMX's tiles
        from 4 rows where the CPU has them and in_features is a multiple of 32. Sums in
        float32 in k order, rounded once: F.linear's result but for about one output in
        20,000 (10,000 with AMX), one bfloat16 unit apart. A tied LM head gets a packed
        copy.

        `onednn_copy`: oneDNN's prepacked layout is kept too, for steps of more than
        PAIRS_MAX_ROWS rows (prompts), where oneDNN's kernel is the faster.

        `silu_halves`: this is an MLP's gate and up (halves of a multiple of 16 columns)
        whose output only silu(gate) * up reads: the pairs hold 16 columns of each a panel
        and compute silu(gate) * up as they store (`silu_and_mul`), so the gate/up output
        is never written nor read back (`silu_pairs`)."""
        if self.weight_pairs is not None:
            return
        source = self._out_in_weight().contiguous()
        if silu_halves and self.out_features % 32 == 0:
            self.weight_pairs = torch.ops.duoserve.pack_bf16_gate_up_pairs(source)
            self.silu_pairs = True
        else:
            self.weight_pairs = torch.ops.duoserve.pack_bf16_pairs(source)
        if onednn_copy:
            self.weight_onednn = torch.ops.mkldnn._reorder_linear_weight(source)
        self._drop_plain_weights()

    def use_onednn(self, keep_rows: bool = False) -> None:
        """bfloat16 where torch's bfloat16 matmul is oneDNN's (AMX, AVX512-BF16) and the pairs
        layout is not taken (an odd in_features; a build without AVX512-BF16's dot products,
        or on an AMX CPU without AMX's tiles): the weight reordered once into the blocked
        layout oneDNN's kernels read, as torch.compile's CPU weight prepacking does, instead
        of at every call. Results were F.linear's bit for bit on
        the AMX Xeon (test_onednn_linear.py checks it wherever this path is taken). A tied
        LM head gets a prepacked copy of the embeddings, as `pack()` does.

        `keep_rows`: the [out, in] weight stays too, and a single row goes through the row
        GEMV. oneDNN spends about 45 us a call before it streams the weight: at one row the
        model's 121 projections took 24.8 ms there against 18.2 through the GEMV (the
        Xeon, SmolLM2), at the cost of a second copy of the weights."""
        if self.weight_onednn is not None:
            return
        source = self._out_in_weight().contiguous()
        self.weight_onednn = torch.ops.mkldnn._reorder_linear_weight(source)
        self._drop_plain_weights()
        if keep_rows:
            if not self.shared_weight:  # a tied LM head reads the embeddings themselves
                self.weight = nn.Parameter(source, requires_grad=False)
            self.row_gemv = True

    def _out_in_weight(self) -> torch.Tensor:
        """The weight in Hugging Face's [out, in] layout, from whichever plain one is held."""
        return self.weight_t.t() if self.weight_t is not None else self.weight.detach()

    def _drop_plain_weights(self) -> None:
        self.weight_t = None
        if hasattr(self, "weight") and not self.shared_weight:
            del self.weight

    def use_row_gemv(self) -> None:
        """bfloat16 where torch's matmul is oneDNN's: the weight back in [out, in] (F.linear
        read it 1.1-1.2x faster than [in, out] there, at 1 to 64 rows), and a single row
        through the C++ GEMV, which streams those rows (kernels/csrc/row_gemv.cpp)."""
        if self.weight_t is not None:
            self.weight = nn.Parameter(self.weight_t.t().contiguous(), requires_grad=False)
            self.weight_t = None
        self.row_gemv = True

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this projection's output, its halves gate and up (an MLP's
        gate_up), with the C++ kernels' roundings (torch's silu, then mul)."""
        if self.silu_pairs and self._takes_pairs(x):
            return torch.ops.duoserve.bf16_pairs_silu_mul(
                x, self.weight_pairs, self.out_features, self.bias
            )
        return torch.ops.duoserve.silu_and_mul(self(x))

    def _takes_pairs(self, x: torch.Tensor) -> bool:
        return self.weight_pairs is not None and (
            self.weight_onednn is None or x.shape[0] <= PAIRS_MAX_ROWS
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_gemv and x.dim() == 2 and x.shape[0] == 1:
            return torch.ops.duoserve.row_gemv(x, self.weight, self.bias)
        if self._takes_pairs(x):
            if self.silu_pairs:
                raise RuntimeError("these gate/up pairs compute silu(gate) * up: silu_and_mul")
            return torch.ops.duoserve.bf16_pairs_linear(
                x, self.weight_pairs, self.out_features, self.bias
            )
        if self.weight_onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x, self.weight_onednn, self.bias, "none", [], ""
            )
        if self.weight_packed is not None:
            return torch.ops.duoserve.packed_linear(
                x, self.weight_packed, self.out_features, self.bias
            )
        if self.weight_t is not None:
            return matmul(x, self.weight_t, self.bias)
        return F.linear(x, self.weight, self.bias)

    def kernel_args(self) -> tuple[list[torch.Tensor | None], list[int]]:
        """`forward`'s choice, for C++ code that runs it (decode_layers.cpp's `project`;
        decode steps, so the pairs layout where there is one):
        (the one-row GEMV's weight or None, the main path's weight, the bias or None),
        (the main path, out_features). Kept beside forward: the two choose alike."""
        row_weight = self.weight if self.row_gemv else None
        if self.weight_pairs is not None:
            path = PAIRS_SILU_PATH if self.silu_pairs else PAIRS_PATH
            weight = self.weight_pairs
        elif self.weight_onednn is not None:
            path, weight = ONEDNN_PATH, self.weight_onednn
        elif self.weight_packed is not None:
            path, weight = PACKED_PATH, self.weight_packed
        elif self.weight_t is not None:
            path, weight = MATMUL_PATH, self.weight_t
        else:
            path, weight = LINEAR_PATH, self.weight
        return [row_weight, weight, self.bias], [path, self.out_features]
