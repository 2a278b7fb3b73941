// The AVX-512 register-tile GEMM step shared by the kernels: C = A . panel (+ bias) for a
// few rows at a time, the panel being K rows of 16 x kVecs contiguous columns.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace duoserve::avx512 {

// C[rows x cols] = A[rows x K] . panel[K x 16 * kVecs] (+ bias), with kRows x kVecs
// accumulators in registers. `prefetch` lines of the next panel are requested over the loop.
template <int kRows, int kVecs>
void register_tile(const float* __restrict a, int64_t lda, const float* __restrict panel,
                   int64_t k, const float* __restrict bias, float* __restrict c, int64_t ldc,
                   int64_t cols, const char* next, int64_t prefetch) {
  __mmask16 lanes[kVecs];  // the columns that exist: the last block may be padding
  __m512 acc[kRows][kVecs];
  for (int v = 0; v < kVecs; ++v) {
    const int64_t count = std::clamp<int64_t>(cols - 16 * v, 0, 16);
    lanes[v] = static_cast<__mmask16>((1u << count) - 1);
    const __m512 init =
        bias != nullptr ? _mm512_maskz_loadu_ps(lanes[v], bias + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < kRows; ++r) acc[r][v] = init;
  }
  const int64_t per_step = (prefetch + k - 1) / k;
  for (int64_t kk = 0; kk < k; ++kk) {
    for (int64_t line = kk * per_step; line < std::min(prefetch, (kk + 1) * per_step); ++line) {
      _mm_prefetch(next + 64 * line, _MM_HINT_T1);
    }
    __m512 b[kVecs];
    for (int v = 0; v < kVecs; ++v) b[v] = _mm512_loadu_ps(panel + (kk * kVecs + v) * 16);
    for (int r = 0; r < kRows; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + kk]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_fmadd_ps(x, b[v], acc[r][v]);
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    for (int r = 0; r < kRows; ++r) _mm512_mask_storeu_ps(c + r * ldc + 16 * v, lanes[v], acc[r][v]);
  }
}

// The rows of a tile that fit the registers: 24 accumulators, whatever the block width.
template <int kVecs>
constexpr int tile_rows() { return 24 / kVecs; }

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
  const int64_t lines = next == nullptr ? 0 : k * kVecs * 16 * 4 / 64;
  const int64_t share = (lines + tiles - 1) / tiles;
  const char* next_bytes = reinterpret_cast<const char*>(next);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m0 = t * kRows;
    const int64_t prefetch = std::clamp<int64_t>(lines - t * share, 0, share);
    register_tile_rows<kVecs>(std::min(kRows, m - m0), a + m0 * lda, lda, panel, k, bias,
                              c + m0 * ldc, ldc, cols, next_bytes + 64 * t * share, prefetch);
  }
}

}  // namespace duoserve::avx512
#endif  // __AVX512F__
