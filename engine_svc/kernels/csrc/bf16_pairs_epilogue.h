// What bf16_pairs_linear.cpp's two paths share over the panels packed in pairs of k: the
// panel's width, where its results go (a plain output, or silu(gate) * up's), and the
// epilogue that adds the bias and rounds each sum to bfloat16 once (the dot-product tiles and
// the one-row GEMV there, the AMX tiles in bf16_pairs_amx.h).
#pragma once

#include "vec.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

namespace duoserve {
namespace bf16_pairs {

// Columns per panel: two vectors of 16.
constexpr int64_t kPairsBlock = 32;

// Where the panels' results go: panel b's 32 columns of a [rows, n] output; or, over the
// pairs of an MLP's gate and up packed 16 columns of each a panel (gate's first), silu(gate)
// * up's 16 columns of a [rows, n / 2] output, so the gate/up output is never written.
struct Output {
  at::BFloat16* c;
  int64_t n;  // the packed weight's columns
  bool silu_mul;

  int64_t ldc() const { return silu_mul ? n / 2 : n; }
  at::BFloat16* panel_row(int64_t row, int64_t b) const {
    return c + row * ldc() + b * (silu_mul ? kPairsBlock / 2 : kPairsBlock);
  }
  int64_t cols(int64_t b) const { return std::min(kPairsBlock, n - b * kPairsBlock); }
};

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)

// The first `cols` lanes of a vector of columns (none where cols <= 0).
inline __mmask16 column_mask(int64_t cols) {
  return static_cast<__mmask16>((1u << std::clamp<int64_t>(cols, 0, 16)) - 1u);
}

// The bias of a vector of columns, or zeros without one.
inline __m512 bias_lanes(const float* bias, __mmask16 mask) {
  return bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
}

// A vector of sums plus the bias (where there is one: -0 stays -0 without), rounded to
// bfloat16 once, into c's lanes under mask.
inline void store_rounded(__m512 sum, bool has_bias, __m512 bias, __mmask16 mask,
                          at::BFloat16* c) {
  if (has_bias) sum = _mm512_add_ps(sum, bias);
  _mm256_mask_storeu_epi16(c, mask, (__m256i)_mm512_cvtneps_pbh(sum));
}

// The epilogue's helpers always inlined: GCC had left some as calls (vector arguments
// through memory, a vzeroupper before each), and one-row steps ran 1.15-1.2x slower.
#define DUOSERVE_INLINE __attribute__((always_inline)) inline

// The bfloat16 value store_rounded stores for a vector of sums, as float32.
DUOSERVE_INLINE fvec rounded(__m512 sum, bool has_bias, __m512 bias) {
  if (has_bias) sum = _mm512_add_ps(sum, bias);
  const __m512i wide = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(sum));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// 16 columns of silu(gate) * up from the sums of gate's and up's, each rounded to bfloat16
// first: what silu_and_mul makes of the stored gate/up output, bit for bit.
DUOSERVE_INLINE void store_silu_mul(__m512 gate, __m512 up, bool has_bias, __m512 gate_bias,
                           __m512 up_bias, at::BFloat16* c) {
  store_bf16(silu_times<at::BFloat16>(rounded(gate, has_bias, gate_bias),
                                      rounded(up, has_bias, up_bias)),
             c);
}

// The bias of a panel's `cols` columns as its two vectors (zeros without one).
struct PanelBias {
  const float* bias;
  __m512 low, high;

  DUOSERVE_INLINE PanelBias(const float* bias, int64_t cols)
      : bias(bias), low(bias_lanes(bias, column_mask(cols))),
        high(bias_lanes(bias == nullptr ? nullptr : bias + 16, column_mask(cols - 16))) {}
};

// The epilogue of a panel's row: its two vectors of sums (columns 0-15 and 16-31) plus the
// bias, rounded, as `out` takes them, into c (out.panel_row(row, panel)).
DUOSERVE_INLINE void store_panel_row(__m512 low, __m512 high, const PanelBias& bias,
                                     bool silu_mul, int64_t cols, at::BFloat16* c) {
  const bool has_bias = bias.bias != nullptr;
  if (silu_mul) {
    store_silu_mul(low, high, has_bias, bias.low, bias.high, c);
    return;
  }
  store_rounded(low, has_bias, bias.low, column_mask(cols), c);
  store_rounded(high, has_bias, bias.high, column_mask(cols - 16), c + 16);
}

#undef DUOSERVE_INLINE

#endif

}  // namespace bf16_pairs
}  // namespace duoserve
