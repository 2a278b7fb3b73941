// One row (a lone request's decode step), or a few (float32), times a weight packed in column
// panels (packed_linear.cpp's layout): 1-8 float32 rows on AVX2 and 1-2 on AVX-512
// (packed_linear.cpp's kMaxGemvRows), one bfloat16 row where torch has no bfloat16
// arithmetic. Each thread streams its panels from memory once, several side by side.
#pragma once

#include "vec.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>

#include "stealing.h"

namespace duoserve {

// Values a packed panel of `block` columns holds: K rows of float32, K rounded up to whole
// pairs of bfloat16.
template <typename W>
constexpr int64_t panel_size(int64_t k, int64_t block) {
  return (std::is_same_v<W, at::BFloat16> ? (k + 1) / 2 * 2 : k) * block;
}

// float32, kRows rows times kPanels panels at once: each k's value of each row times that
// k's line of every panel, so a thread reads kPanels streams side by side. Each column
// vector's sum runs in k order from zero and the bias is added last, the order brgemm sums a
// row in, so a row gets the same bits alone as in a batch (tested), however many rows and
// panels go together.
// At one row brgemm paid its per-call set-up for every panel (a decode step's 121 projections
// make ~2,400 panel calls a thread): on the AMD EPYC Zen 1 (AVX2), SmolLM2-135M's projections
// and LM head with weights streaming from memory took 26.0-29.3 ms one panel at a time against
// 29.3-32.2 through brgemm (six alternating pairs in one process); software prefetches of
// 256 B to 8 KB ahead, into L1 or L2, were no faster there. One stream a thread left memory
// idle: on the AMD EPYC Zen 3 (family 25 model 1), SmolLM2's 120 decoder projections (425 MB)
// in a C++ loop, two threads, took 9.2-11.2 ms with 4 panels at once, 9.8-11.4 with 3,
// 11.3-11.7 with 2 and 14.3-16.1 with one (five alternating rounds in one process); in a
// one-request decode step the forward went from 16.0 to 14.4 ms (medians of 384 steps each,
// alternating step by step).
template <int kVecs, int kRows, int kPanels>
void gemv_panels(const float* __restrict a, int64_t lda, const float* const* panels, int64_t k,
                 const float* const* biases, float* const* outs, int64_t ldc,
                 const int64_t* cols) {
  vreg acc[kRows][kPanels][kVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int p = 0; p < kPanels; ++p) {
      for (int v = 0; v < kVecs; ++v) acc[r][p][v] = fvec(0.0f);
    }
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    vreg x[kRows];
    for (int r = 0; r < kRows; ++r) x[r] = fvec(a[r * lda + kk]);
    for (int p = 0; p < kPanels; ++p) {
      for (int v = 0; v < kVecs; ++v) {
        const vreg w = fvec::loadu(panels[p] + (kk * kVecs + v) * kLanes);
        for (int r = 0; r < kRows; ++r) acc[r][p][v] = fmadd(x[r], w, acc[r][p][v]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int p = 0; p < kPanels; ++p) {
      for (int v = 0; v < kVecs; ++v) {
        const int64_t lanes = std::clamp<int64_t>(cols[p] - kLanes * v, 0, kLanes);
        fvec sum = fvec(acc[r][p][v]);
        if (biases[p] != nullptr) sum = sum + fvec::loadu(biases[p] + kLanes * v, lanes);
        sum.store(outs[p] + r * ldc + kLanes * v, lanes);
      }
    }
  }
}

// Panels a GEMV step takes together: up to 4 (the measured best, above and below; on the Zen 4
// at AVX-512, one row over SmolLM2's 120 projections, 3, 4, 6 and 8 at once measured alike:
// 15.1-15.8 ms, alternating in one process), fewer where a float32 step's accumulators for
// kRows rows would not leave registers for the rows' values and a panel vector.
template <int kVecs, int kRows = 1>
constexpr int gemv_panels_at_once() {
  return std::clamp((kVectorRegisters - 4) / (kRows * kVecs), 1, 4);
}

// bfloat16, packed in pairs of k, kPanels panels at once as float32's: each pair row is
// widened in registers (load_bf16_pairs: one load for two k's worth of a vector of columns),
// not into a scratch panel that brgemm then reads again (at one row the widening pass cost as
// much as the product). A pair's first k and its second go to two accumulator sets, which
// hides the FMA latency of a single row; the sums run in float32 in k order per set, added at
// the end. Measured on the AMD EPYC Zen 1 (AVX2; SmolLM2-135M's projections and LM head, 269
// MB of bfloat16 streaming from memory, both threads, one call at a time from Python), one
// panel at a time: 15.1-15.2 ms against 17.4-17.5 with k-major panels (a widening load and a
// shift per vector of columns, one line in three requested ahead). On the Zen 3, the 120
// decoder projections (212 MB) in a C++ loop: 8.0-8.8 ms with 4 panels at once, 7.8-8.8 with
// 3, 8.3-9.5 with 2 and 10.4-11.2 with one (five alternating rounds in one process; 4 spill
// some of their 24 accumulators on AVX2 and still kept up).
// No software prefetch: the hardware's follows the 4 streams. Requesting each line 4 KB ahead
// (what one panel at a time had on the Zen 1) made the Zen 3 slower, the same bits either
// way: a one-request decode step's layers 8.04 and 7.88 ms (medians of 384 steps) against
// 7.53 and 7.32 without, alternating step by step in one process (two runs); the projections
// and LM head from Python, alternating call by call, 10.17 and 12.63 ms against 9.57, 11.87.

template <int kVecs, int kRows, int kPanels>
void gemv_panels(const float* __restrict a, int64_t, const at::BFloat16* const* panels,
                 int64_t k, const float* const* biases, at::BFloat16* const* outs, int64_t,
                 const int64_t* cols) {
  static_assert(kRows == 1, "bfloat16 panels take one row");
  constexpr int64_t kPairRow = 2 * kVecs * kLanes;  // bfloat16 values in a pair row
  vreg first[kPanels][kVecs], second[kPanels][kVecs];
  for (int p = 0; p < kPanels; ++p) {
    for (int v = 0; v < kVecs; ++v) first[p][v] = second[p][v] = fvec(0.0f);
  }
  const int64_t whole_pairs = k / 2;
  for (int64_t pair = 0; pair < whole_pairs; ++pair) {
    const vreg x0 = fvec(a[2 * pair]), x1 = fvec(a[2 * pair + 1]);
    for (int p = 0; p < kPanels; ++p) {
      const at::BFloat16* row = panels[p] + pair * kPairRow;
      for (int v = 0; v < kVecs; ++v) {
        vreg w0, w1;
        load_bf16_pairs(row + v * 2 * kLanes, w0, w1);
        first[p][v] = fmadd(x0, w0, first[p][v]);
        second[p][v] = fmadd(x1, w1, second[p][v]);
      }
    }
  }
  if (k % 2 == 1) {  // the last k alone: its pair's second value is padding
    const vreg x = fvec(a[k - 1]);
    for (int p = 0; p < kPanels; ++p) {
      const at::BFloat16* row = panels[p] + whole_pairs * kPairRow;
      for (int v = 0; v < kVecs; ++v) {
        vreg w0, w1;
        load_bf16_pairs(row + v * 2 * kLanes, w0, w1);
        first[p][v] = fmadd(x, w0, first[p][v]);
      }
    }
  }
  for (int p = 0; p < kPanels; ++p) {
    for (int v = 0; v < kVecs; ++v) {
      const int64_t lanes = std::clamp<int64_t>(cols[p] - kLanes * v, 0, kLanes);
      fvec sum = fvec(first[p][v]) + fvec(second[p][v]);
      if (biases[p] != nullptr) sum = sum + fvec::loadu(biases[p] + kLanes * v, lanes);
      // Rounded as torch's float32 -> bfloat16 conversion rounds (to nearest even, NaN kept).
      __at_align__ float sums[kLanes];
      sum.store(sums, lanes);
      for (int64_t i = 0; i < lanes; ++i) {
        outs[p][kLanes * v + i] = static_cast<at::BFloat16>(sums[i]);
      }
    }
  }
}

// Each of a group's output pointers `offset` elements on.
template <typename W, int kPanels>
std::array<W*, kPanels> shifted(W* const* outs, int64_t offset) {
  std::array<W*, kPanels> moved;
  for (int p = 0; p < kPanels; ++p) moved[p] = outs[p] + offset;
  return moved;
}

// Rows [0, m) of `a` times the panels of a group, kRows rows at a time (fewer at the end).
template <int kVecs, int kRows, int kPanels, typename W>
void rows_times_panels(const float* a, int64_t lda, int64_t m, const W* const* panels, int64_t k,
                       const float* const* biases, W* const* outs, int64_t ldc,
                       const int64_t* cols) {
  int64_t r0 = 0;
  for (; r0 + kRows <= m; r0 += kRows) {
    gemv_panels<kVecs, kRows, kPanels>(a + r0 * lda, lda, panels, k, biases,
                                       shifted<W, kPanels>(outs, r0 * ldc).data(), ldc, cols);
  }
  if constexpr (kRows > 1) {
    if (r0 < m) {
      const auto rest = shifted<W, kPanels>(outs, r0 * ldc);
      rows_times_panels<kVecs, kRows - 1, kPanels>(a + r0 * lda, lda, m - r0, panels, k, biases,
                                                   rest.data(), ldc, cols);
    }
  }
}

// The panels a thread takes from its cursor, in groups of up to kPanels as even as its range
// allows (for_each_group), each group times all m rows, kRows at a time: the group's panels
// stream from memory for the first rows and come from L2 for the others. Two rows a pass
// (two panels) measured faster on the Zen 3 than one (four panels) at 2-16 rows; 3 or 4 rows
// a pass (one panel) ran no faster than brgemm at 3-4 rows.
template <int kVecs, int kRows, typename W>
void gemv_panel_groups(StealingCursor& cursor, const float* a, int64_t lda, int64_t m,
                       const W* weights, int64_t k, const float* bias, W* c, int64_t n) {
  constexpr int kPanels = gemv_panels_at_once<kVecs, kRows>();
  constexpr int64_t block = kVecs * kLanes;
  for_each_group<kPanels>(cursor, [&](const int64_t* items, int count) {
    const W* panels[kPanels];
    const float* biases[kPanels];
    W* outs[kPanels];
    int64_t cols[kPanels];
    for (int i = 0; i < count; ++i) {
      const int64_t b = items[i];
      panels[i] = weights + b * panel_size<W>(k, block);
      biases[i] = bias != nullptr ? bias + b * block : nullptr;
      outs[i] = c + b * block;
      cols[i] = std::min(block, n - b * block);
    }
    with_count<kPanels>(count, [&](auto size) {
      rows_times_panels<kVecs, kRows, decltype(size)::value>(a, lda, m, panels, k, biases, outs,
                                                             n, cols);
    });
  });
}

// m rows (1 for bfloat16; at most kMaxGemvRows) over every panel, the threads stealing them.
template <int kVecs, typename W>
void gemv(const float* a, int64_t lda, int64_t m, const W* weights, int64_t num_blocks,
          int64_t k, const float* bias, W* c, int64_t n) {
  parallel_stealing(num_blocks, [&](StealingCursor& cursor) {
    if constexpr (std::is_same_v<W, float>) {
      if (m == 1) {
        gemv_panel_groups<kVecs, 1>(cursor, a, lda, m, weights, k, bias, c, n);
      } else {
        gemv_panel_groups<kVecs, 2>(cursor, a, lda, m, weights, k, bias, c, n);
      }
    } else {
      gemv_panel_groups<kVecs, 1>(cursor, a, lda, m, weights, k, bias, c, n);
    }
  });
}

// The panel widths gemv is compiled for (vectors per block), or false.
template <typename W>
bool gemv_any(int64_t vectors, const float* a, int64_t lda, int64_t m, const W* weights,
              int64_t num_blocks, int64_t k, const float* bias, W* c, int64_t n) {
  switch (vectors) {
    case 2: gemv<2>(a, lda, m, weights, num_blocks, k, bias, c, n); return true;
    case 3: gemv<3>(a, lda, m, weights, num_blocks, k, bias, c, n); return true;
    case 4: gemv<4>(a, lda, m, weights, num_blocks, k, bias, c, n); return true;
    default: return false;
  }
}

}  // namespace duoserve
