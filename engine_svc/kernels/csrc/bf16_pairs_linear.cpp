// bfloat16 projections for decode's row counts on AVX512-BF16 (vdpbf16ps) and, where the
// CPU has them, AMX's tiles, over weights packed once in pairs of k.
//
// oneDNN's prepacked bfloat16 GEMM runs near the FMA units' peak when its weights are in
// cache, but in a decode step every projection's weights stream from memory, and its kernel
// does not fetch ahead: SmolLM2-135M's 120 decoder projections at 64 rows took 19 ms with
// the weights streaming against 14.5 with them in cache (the Zen 5), about the time the
// 212 MB take to arrive. Here, as the float32 register tile does (gemm_tile.h), each panel
// of columns is computed while the thread's next panel is requested into L2, spread over the
// loop; one row (a lone request) reads up to four panels side by side instead (pairs_row).
//
// Layout: [ceil(N / block), K / 2, block, 2]: each panel is K / 2 steps of `block` columns
// times two consecutive k, so one 64-byte vector holds 16 columns' pairs, what vdpbf16ps
// multiplies by a broadcast pair of the row's k. The sums run in float32 in k order, a pair
// at a time, each output in one accumulator; the bias is added to the sum and the result
// rounded to bfloat16 once, at the end.
//
// An MLP's gate/up projection can be packed with 16 columns of gate and the same 16 of up in
// each panel (pack_bf16_gate_up_pairs): its kernels then store silu(gate) * up, the gate/up
// output never written nor read back (bf16_pairs_silu_mul), bit for bit what silu_and_mul
// makes of bf16_pairs_linear's output.
//
// The panel's epilogue (the bias, the rounding, silu * up) is bf16_pairs_epilogue.h's; the AMX
// path bf16_pairs_amx.h's.

#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "amx.h"
#include "bf16_pairs_amx.h"
#include "bf16_pairs_epilogue.h"
#include "stealing.h"

namespace duoserve {
namespace {

using namespace bf16_pairs;

at::Tensor pack_bf16_pairs(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be bfloat16 [out_features, in_features]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % 2 == 0, "in_features must be even, got ", k);
  const int64_t blocks = (n + kPairsBlock - 1) / kPairsBlock;
  auto padded = at::zeros({blocks * kPairsBlock, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [blocks, block, K / 2, 2] -> [blocks, K / 2, block, 2]
  return padded.view({blocks, kPairsBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)

constexpr int kVecs = kPairsBlock / 16;
constexpr int kMaxRows = 12;  // 24 accumulators, 2 panel vectors and the broadcast pair

// kSiluMul a template argument: the plain kernel's code stays the same with the silu
// epilogue beside it.
template <int kRows, bool kSiluMul>
void pairs_tile(const at::BFloat16* __restrict a, int64_t lda, const at::BFloat16* __restrict panel,
                int64_t pairs, const float* __restrict bias, at::BFloat16* __restrict c,
                int64_t ldc, int64_t cols, const char* next, int64_t prefetch) {
  static_assert(kVecs == 2, "the epilogue takes a panel as two vectors of columns");
  __m512 acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  const int64_t per_step = (prefetch + pairs - 1) / pairs;
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t line = p * per_step; line < std::min(prefetch, (p + 1) * per_step); ++line) {
      prefetch_l2(next + 64 * line);
    }
    __m512bh b[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      b[v] = (__m512bh)_mm512_loadu_si512(panel + (p * kVecs + v) * 32);
    }
    for (int r = 0; r < kRows; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof(pair));
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, b[v]);
    }
  }
  if constexpr (kSiluMul) {
    const PanelBias panel_bias(bias, cols);
    for (int r = 0; r < kRows; ++r) {
      store_silu_mul(acc[r][0], acc[r][1], bias != nullptr, panel_bias.low, panel_bias.high,
                     c + r * ldc);
    }
  } else {
    for (int v = 0; v < kVecs; ++v) {
      const __mmask16 mask = column_mask(cols - 16 * v);
      const __m512 add = bias_lanes(bias == nullptr ? nullptr : bias + 16 * v, mask);
      for (int r = 0; r < kRows; ++r) {
        store_rounded(acc[r][v], bias != nullptr, add, mask, c + r * ldc + 16 * v);
      }
    }
  }
}

template <bool kSiluMul, int kRows = kMaxRows>
void pairs_tile_rows(int64_t rows, const at::BFloat16* a, int64_t lda,
                     const at::BFloat16* panel, int64_t pairs, const float* bias,
                     at::BFloat16* c, int64_t ldc, int64_t cols, const char* next,
                     int64_t prefetch) {
  if constexpr (kRows > 1) {
    if (rows < kRows) {
      pairs_tile_rows<kSiluMul, kRows - 1>(rows, a, lda, panel, pairs, bias, c, ldc, cols,
                                           next, prefetch);
      return;
    }
  }
  pairs_tile<kRows, kSiluMul>(a, lda, panel, pairs, bias, c, ldc, cols, next, prefetch);
}

template <bool kSiluMul>
void pairs_gemm(const at::BFloat16* a, int64_t lda, int64_t m, const at::BFloat16* packed,
                int64_t blocks, int64_t pairs, const float* bias, const Output& out) {
  const int64_t panel_size = pairs * kPairsBlock * 2;
  const int64_t lines = panel_size * 2 / 64;
  const int64_t tiles = (m + kMaxRows - 1) / kMaxRows;
  const int64_t share = (lines + tiles - 1) / tiles;
  parallel_stealing(blocks, [&](StealingCursor& cursor) {
    for (int64_t b = cursor.next(); b >= 0; b = cursor.next()) {
      const at::BFloat16* panel = packed + b * panel_size;
      const char* next = cursor.continues_with(b + 1)
                             ? reinterpret_cast<const char*>(panel + panel_size)
                             : nullptr;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = t * kMaxRows;
        const int64_t prefetch =
            next == nullptr ? 0 : std::clamp<int64_t>(lines - t * share, 0, share);
        pairs_tile_rows<kSiluMul>(std::min<int64_t>(kMaxRows, m - m0), a + m0 * lda, lda,
                                  panel, pairs,
                                  bias != nullptr ? bias + b * kPairsBlock : nullptr,
                                  out.panel_row(m0, b), out.ldc(), out.cols(b),
                                  next == nullptr ? nullptr : next + 64 * t * share, prefetch);
      }
    }
  });
}

// One row (a lone request's decode step), kPanels panels side by side (up to kRowPanels):
// each pair of the row's k times that pair row of every panel, so a thread reads kPanels
// streams at once where the tile above reads one and requests the next (the float32 GEMV's
// pattern, panel_gemv.h). The sums are the tile's (each output's in pair order from zero,
// the same epilogue), so a row gets the same bits alone as in a batch the tile takes (batches of 4
// rows or more on AMX go through its tiles: a unit apart now and then). Also AMX's path for
// one row (its tiles start at 4), not measured there. On the Zen 4 (AVX512-BF16, no
// AMX), a greedy request decoding alone in one process, alternating the two paths round by
// round (128 tokens a round): 0.74-1.10x the tile's time a token, 19 of 20 rounds faster,
// medians 8.55 against 9.63 ms; a second run 0.83-1.02x, 10.64 against 11.26. Two rows over
// four panels side by side measured alike with the tile (0.93-1.07x, median 11.54 against
// 11.75 ms): the tile keeps them.
constexpr int kRowPanels = 4;

template <int kPanels, bool kSiluMul>
void pairs_row(const at::BFloat16* __restrict a, const at::BFloat16* const* panels,
               int64_t pairs, const float* const* biases, at::BFloat16* const* outs,
               const int64_t* cols) {
  __m512 acc[kPanels][kVecs];
  for (int q = 0; q < kPanels; ++q) {
    for (int v = 0; v < kVecs; ++v) acc[q][v] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    int32_t pair;
    std::memcpy(&pair, a + 2 * p, sizeof(pair));
    const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
    for (int q = 0; q < kPanels; ++q) {
      for (int v = 0; v < kVecs; ++v) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(panels[q] + (p * kVecs + v) * 32);
        acc[q][v] = _mm512_dpbf16_ps(acc[q][v], x, w);
      }
    }
  }
  for (int q = 0; q < kPanels; ++q) {
    store_panel_row(acc[q][0], acc[q][1], PanelBias(biases[q], cols[q]), kSiluMul, cols[q],
                    outs[q]);
  }
}

// The row over every panel, the threads stealing them in groups of up to kRowPanels, as even
// as each thread's range allows (for_each_group).
template <bool kSiluMul>
void pairs_gemv(const at::BFloat16* a, const at::BFloat16* packed, int64_t blocks,
                int64_t pairs, const float* bias, const Output& out) {
  const int64_t panel_size = pairs * kPairsBlock * 2;
  parallel_stealing(blocks, [&](StealingCursor& cursor) {
    for_each_group<kRowPanels>(cursor, [&](const int64_t* items, int count) {
      const at::BFloat16* panels[kRowPanels];
      const float* biases[kRowPanels];
      at::BFloat16* outs[kRowPanels];
      int64_t cols[kRowPanels];
      for (int i = 0; i < count; ++i) {
        const int64_t b = items[i];
        panels[i] = packed + b * panel_size;
        biases[i] = bias != nullptr ? bias + b * kPairsBlock : nullptr;
        outs[i] = out.panel_row(0, b);
        cols[i] = out.cols(b);
      }
      with_count<kRowPanels>(count, [&](auto size) {
        pairs_row<decltype(size)::value, kSiluMul>(a, panels, pairs, biases, outs, cols);
      });
    });
  });
}

#endif

// Whether this process multiplies pairs with AMX's tiles: built with them, and the
// kernel granted them.
bool amx_tiles_usable() {
#if DUOSERVE_AMX_TILES
  return amx_permitted();
#else
  return false;
#endif
}

// [gate; up] rows of an MLP's fused projection, [2 * width, in], interleaved 16 at a time
// (gate's rows 0-15, up's 0-15, gate's 16-31, ...): packed in pairs, each panel holds 16
// columns of gate and the same 16 of up, for the silu(gate) * up epilogue.
at::Tensor gate_up_interleaved(const at::Tensor& rows) {
  const int64_t width = rows.size(0) / 2;
  TORCH_CHECK(rows.size(0) % 2 == 0 && width % 16 == 0,
              "gate/up: the halves must be a multiple of 16 rows, got ", rows.size(0));
  std::vector<int64_t> interleaved{width / 16, 2, 16};
  std::vector<int64_t> halves{2, width / 16, 16};
  const at::IntArrayRef tail = rows.sizes().slice(1);
  halves.insert(halves.end(), tail.begin(), tail.end());
  interleaved.insert(interleaved.end(), tail.begin(), tail.end());
  std::vector<int64_t> order{1, 0, 2};
  for (int64_t d = 1; d < rows.dim(); ++d) order.push_back(d + 2);
  return rows.reshape(halves).permute(order).reshape(rows.sizes());
}

at::Tensor pack_bf16_gate_up_pairs(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [2 * width, in_features]");
  return pack_bf16_pairs(gate_up_interleaved(weight));
}

// x through the packed weight into `out_features` columns, or into silu(gate) * up's
// out_features / 2 where the weight is pack_bf16_gate_up_pairs'.
at::Tensor pairs_forward(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias, bool silu_mul) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == kPairsBlock && packed.size(3) == 2,
              "packed must be pack_bf16_pairs' [blocks, in_features / 2, 32, 2]");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bfloat16 [rows, in]");
  const int64_t pairs = packed.size(1), n = out_features;
  TORCH_CHECK(x.size(1) == 2 * pairs, "x has ", x.size(1), " features, the weight takes ",
              2 * pairs);
  TORCH_CHECK(n >= 1 && n <= packed.size(0) * kPairsBlock &&
                  n > (packed.size(0) - 1) * kPairsBlock,
              "out_features does not match the packed weight");
  TORCH_CHECK(!silu_mul || n % kPairsBlock == 0,
              "gate/up pairs: out_features must be a multiple of 32, got ", n);
  std::optional<at::Tensor> bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n && bias->scalar_type() == at::kBFloat16,
                "bias must be bfloat16 [out_features]");
    bias32 = (silu_mul ? gate_up_interleaved(*bias) : *bias).to(at::kFloat).contiguous();
  }
  const at::Tensor a = x.stride(1) == 1 ? x : x.contiguous();
  auto out = at::empty({x.size(0), silu_mul ? n / 2 : n}, x.options());
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  const Output to{out.mutable_data_ptr<at::BFloat16>(), n, silu_mul};
  const float* bias_data = bias32.has_value() ? bias32->const_data_ptr<float>() : nullptr;
#if DUOSERVE_AMX_TILES
  if (amx_takes(x.size(0), pairs)) {
    // Rows past the last whole tile read zeros from a padded copy.
    const int64_t m = x.size(0);
    const int64_t m_padded = (m + kTileRows - 1) / kTileRows * kTileRows;
    at::Tensor rows = a;
    if (m_padded != m) {
      rows = at::empty({m_padded, a.size(1)}, a.options());
      rows.narrow(0, 0, m).copy_(a);
      rows.narrow(0, m, m_padded - m).zero_();
    }
    amx_gemm(rows.const_data_ptr<at::BFloat16>(), rows.stride(0), m, m_padded,
             packed.const_data_ptr<at::BFloat16>(), packed.size(0), pairs, bias_data, to);
    return out;
  }
#endif
  if (x.size(0) == 1) {
    (silu_mul ? pairs_gemv<true> : pairs_gemv<false>)(a.const_data_ptr<at::BFloat16>(),
                                                      packed.const_data_ptr<at::BFloat16>(),
                                                      packed.size(0), pairs, bias_data, to);
    return out;
  }
  if (x.size(0) > 0) {
    (silu_mul ? pairs_gemm<true> : pairs_gemm<false>)(
        a.const_data_ptr<at::BFloat16>(), a.stride(0), a.size(0),
        packed.const_data_ptr<at::BFloat16>(), packed.size(0), pairs, bias_data, to);
  }
  return out;
#else
  TORCH_CHECK(false, "bf16_pairs_linear: this build has no AVX512-BF16 dot products");
#endif
}

at::Tensor bf16_pairs_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                             const std::optional<at::Tensor>& bias) {
  return pairs_forward(x, packed, out_features, bias, false);
}

// silu(gate) * up of an MLP's [gate; up] projection (out_features = 2 * width) packed by
// pack_bf16_gate_up_pairs, [rows, width]: silu_and_mul(bf16_pairs_linear(...)) of the
// plainly packed weight, bit for bit, without writing the gate/up output.
at::Tensor bf16_pairs_silu_mul(const at::Tensor& x, const at::Tensor& packed,
                               int64_t out_features, const std::optional<at::Tensor>& bias) {
  return pairs_forward(x, packed, out_features, bias, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def("pack_bf16_pairs(Tensor weight) -> Tensor");
  m.def("pack_bf16_gate_up_pairs(Tensor weight) -> Tensor");
  m.def("bf16_pairs_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def(
      "bf16_pairs_silu_mul(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("amx_tiles_usable() -> bool", &amx_tiles_usable);
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) {
  m.impl("pack_bf16_pairs", &pack_bf16_pairs);
  m.impl("pack_bf16_gate_up_pairs", &pack_bf16_gate_up_pairs);
  m.impl("bf16_pairs_linear", &bf16_pairs_linear);
  m.impl("bf16_pairs_silu_mul", &bf16_pairs_silu_mul);
}

}  // namespace duoserve
