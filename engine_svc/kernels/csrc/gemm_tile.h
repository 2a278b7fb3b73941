// The register-tile GEMM step shared by the kernels: C = A . panel (+ bias) for a few rows
// at a time, the panel being K rows of kVecs vectors of contiguous columns. Written on
// Vectorized<float>, so the tile is sized for each level's registers (vec.h).
#pragma once

#include "vec.h"

#include <algorithm>
#include <cstdint>

namespace duoserve {

// C[rows x cols] = A[rows x K] . panel[K x kLanes * kVecs] (+ bias), with kRows x kVecs
// accumulators in registers. `prefetch` lines of the next panel are requested over the loop.
// Each sum runs in k order from zero and the bias comes last, as brgemm and the GEMV
// (panel_gemv.h) sum a row: a row gets the same bits whichever of the three takes its step.
template <int kRows, int kVecs>
void register_tile(const float* __restrict a, int64_t lda, const float* __restrict panel,
                   int64_t k, const float* __restrict bias, float* __restrict c, int64_t ldc,
                   int64_t cols, const char* next, int64_t prefetch) {
  int64_t lanes[kVecs];  // the columns that exist: the last block may be padding
  vreg acc[kRows][kVecs];
  for (int v = 0; v < kVecs; ++v) {
    lanes[v] = std::clamp<int64_t>(cols - kLanes * v, 0, kLanes);
    for (int r = 0; r < kRows; ++r) acc[r][v] = fvec(0.0f);
  }
  const int64_t per_step = (prefetch + k - 1) / k;
  for (int64_t kk = 0; kk < k; ++kk) {
    for (int64_t line = kk * per_step; line < std::min(prefetch, (kk + 1) * per_step); ++line) {
      prefetch_l2(next + 64 * line);
    }
    vreg b[kVecs];
    for (int v = 0; v < kVecs; ++v) b[v] = fvec::loadu(panel + (kk * kVecs + v) * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const vreg x = fvec(a[r * lda + kk]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = fmadd(x, b[v], acc[r][v]);
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    const fvec add = bias != nullptr ? fvec::loadu(bias + kLanes * v, lanes[v]) : fvec(0.0f);
    for (int r = 0; r < kRows; ++r) {
      fvec sum = fvec(acc[r][v]);
      if (bias != nullptr) sum = sum + add;
      sum.store(c + r * ldc + kLanes * v, lanes[v]);
    }
  }
}

// The rows of a tile that fit the registers: kTileAccumulators at most, and room left for
// the panel's kVecs vectors and the broadcast value (AVX2's 16 registers: 2 rows of 4
// vectors, 4 of 3, 6 of 2; AVX-512's 32: 6, 8 and 12).
template <int kVecs>
constexpr int tile_rows() {
  return std::min(kTileAccumulators / kVecs, (kVectorRegisters - kVecs - 1) / kVecs);
}

template <int kVecs, int kRows = tile_rows<kVecs>()>
void register_tile_rows(int64_t rows, const float* a, int64_t lda, const float* panel,
                        int64_t k, const float* bias, float* c, int64_t ldc, int64_t cols,
                        const char* next, int64_t prefetch) {
  if constexpr (kRows > 1) {
    if (rows < kRows) {
      register_tile_rows<kVecs, kRows - 1>(rows, a, lda, panel, k, bias, c, ldc, cols, next,
                                           prefetch);
      return;
    }
  }
  register_tile<kRows, kVecs>(a, lda, panel, k, bias, c, ldc, cols, next, prefetch);
}

// One column block for all rows, tile after tile, each prefetching its share of `next`.
template <int kVecs>
void panel_rows(const float* a, int64_t lda, int64_t m, const float* panel, int64_t k,
                const float* bias, float* c, int64_t ldc, int64_t cols, const float* next) {
  constexpr int64_t kRows = tile_rows<kVecs>();
  const int64_t tiles = (m + kRows - 1) / kRows;
  const int64_t lines = next == nullptr ? 0 : k * kVecs * kLanes * 4 / 64;
  const int64_t share = (lines + tiles - 1) / tiles;
  const char* next_bytes = reinterpret_cast<const char*>(next);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m0 = t * kRows;
    const int64_t prefetch = std::clamp<int64_t>(lines - t * share, 0, share);
    register_tile_rows<kVecs>(std::min(kRows, m - m0), a + m0 * lda, lda, panel, k, bias,
                              c + m0 * ldc, ldc, cols, next_bytes + 64 * t * share, prefetch);
  }
}

// A panel kVecs vectors wide, for a width known only at run time (2, 3 or 4 vectors).
inline bool panel_rows_any(int64_t vectors, const float* a, int64_t lda, int64_t m,
                           const float* panel, int64_t k, const float* bias, float* c,
                           int64_t ldc, int64_t cols, const float* next) {
  switch (vectors) {
    case 4:
      panel_rows<4>(a, lda, m, panel, k, bias, c, ldc, cols, next);
      return true;
    case 3:
      panel_rows<3>(a, lda, m, panel, k, bias, c, ldc, cols, next);
      return true;
    case 2:
      panel_rows<2>(a, lda, m, panel, k, bias, c, ldc, cols, next);
      return true;
    default:
      return false;
  }
}

}  // namespace duoserve
