// bf16_pairs_linear.cpp's panels multiplied by AMX's tiles (amx.h), where the build and the
// kernel grant them.
#pragma once

#include "bf16_pairs_epilogue.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__) && DUOSERVE_AMX_TILES

#include <ATen/Parallel.h>

#include "amx.h"
#include "stealing.h"

namespace duoserve {
namespace bf16_pairs {

// AMX: the same panels, multiplied by tiles. A B tile is 16 pairs of k by 16 columns, one
// 64-byte row a pair: half a pair row of a panel (pair rows lie a panel's 128 bytes apart),
// so the pairs layout is AMX's own and its panels are read as they lie. An A tile is 16 rows
// by 32 k, straight from the activations; a C tile holds 16 x 16 float32 sums. The k order is
// the dot-product kernel's. The first pass over a panel requests its steps kAmxLead ahead
// into L2 (below).
//
// On the 2-core Xeon with AMX, SmolLM2-135M's 120 decoder projections and LM head with the
// weights on huge pages, streaming from memory (ms for all 121, alternating in one process):
// 16 rows 12.7-13.6 against oneDNN's prepacked 18.8-21.2; 64 rows 17.5-23.8 against
// 24.2-25.1; 512 rows 92-95 against 106; 2,048 rows 426-454 against oneDNN's 334-348
// (prompt steps keep oneDNN's copy where it fits). Under 4 rows the dot products
// (memory-bound, no tile set-up) are the faster: 2 rows 11.6-12.1 against 13.4-13.6.

constexpr int64_t kAmxMinRows = 4;
// A step of k: the panel's 16 pair rows two B tiles read, 2 KiB.
constexpr int64_t kStepElements = kTileK * kPairsBlock;
constexpr int64_t kStepLines = kStepElements * 2 / 64;
// The first pass over a panel requests into L2 the step kAmxLead steps ahead (16 KiB, into
// the next panel near the end, the panels lying one after the other): the tile loads had
// waited on memory as long as the tiles computed. SmolLM2-135M's 120 decoder projections and
// LM head at 64 rows, weights streaming, processes alternating: 17.1-17.8 ms against
// 18.4-18.9 (the best of 21 calls, three pairs); 4 and 16 steps ahead measured no better.
// At 64 rows the 120 projections take 15-17 ms against 7.5-8.3 for one row (the bytes alone)
// and 6.9 for the 64 rows' tiles with the weights in cache: memory and tiles add up rather
// than overlap. Measured no faster (the Xeon with AMX, alternating in one session): the next
// panel requested over both 32-row passes; no request at all (the hardware's alone); into L1
// (prefetchnta: twice as slow); one pass of 4 row tiles per column half with the B tiles
// double-buffered; groups of 4-16 panels a pass at a time (the rows' A tiles kept in L1);
// 32- and 16-row chunks each a region of their own.
constexpr int64_t kAmxLead = 8;
// Rows a thread takes through all of its panels before the next rows: a prompt step's
// activations stay in L2 while the thread's panels pass by (2,048 rows in one chunk re-read
// them from L3 for every panel: the 121 projections 477-515 ms against 426-454 in chunks
// of 256 or 512).
constexpr int64_t kChunkRows = 256;

// The tiles (amx.h): 0-3 sums (two row tiles by two column halves), 4-5 rows of A, 6-7 the
// panel's column halves.

// Two C tiles' sums (a panel's columns 0-15 in `sums`, 16-31 at sums + 256, 16 x 16
// float32 each) through the epilogue into c's first `rows` rows.
inline void store_sums(const float* __restrict sums, const float* __restrict bias,
                at::BFloat16* __restrict c, int64_t ldc, int64_t rows, int64_t cols,
                bool silu_mul) {
  const PanelBias panel_bias(bias, cols);
  for (int64_t r = 0; r < rows; ++r) {
    store_panel_row(_mm512_loadu_ps(sums + r * 16), _mm512_loadu_ps(sums + 256 + r * 16),
                    panel_bias, silu_mul, cols, c + r * ldc);
  }
}

// Panel b for rows [0, m) of a, whose rows up to m_padded (a multiple of 16) can be read,
// into out's rows from row0.
inline void amx_panel(const at::BFloat16* a, int64_t lda, int64_t m, int64_t m_padded,
               const at::BFloat16* panel, int64_t pairs, const float* bias, const Output& out,
               int64_t row0, int64_t b, float* sums) {
  constexpr int64_t kPairRow = kPairsBlock * 2 * sizeof(at::BFloat16);
  const int64_t a_stride = lda * static_cast<int64_t>(sizeof(at::BFloat16));
  const int64_t steps = pairs * 2 / kTileK;
  const int64_t ldc = out.ldc(), cols = out.cols(b);
  for (int64_t m0 = 0; m0 < m_padded; m0 += 2 * kTileRows) {
    const bool second = m0 + kTileRows < m_padded;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const at::BFloat16* rows = a + m0 * lda;
    for (int64_t s = 0; s < steps; ++s) {
      const at::BFloat16* step = panel + s * kStepElements;
      if (m0 == 0) {  // the first pass over the panel requests what is kAmxLead ahead
        const char* ahead = reinterpret_cast<const char*>(step + kAmxLead * kStepElements);
        for (int64_t line = 0; line < kStepLines; ++line) prefetch_l2(ahead + 64 * line);
      }
      _tile_loadd(6, step, kPairRow);
      _tile_loadd(7, step + 32, kPairRow);
      _tile_loadd(4, rows + s * kTileK, a_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (second) {
        _tile_loadd(5, rows + kTileRows * lda + s * kTileK, a_stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, sums, 64);
    _tile_stored(1, sums + 256, 64);
    store_sums(sums, bias, out.panel_row(row0 + m0, b), ldc, std::min(kTileRows, m - m0), cols,
               out.silu_mul);
    const int64_t second_rows = std::clamp<int64_t>(m - m0 - kTileRows, 0, kTileRows);
    if (second_rows > 0) {
      _tile_stored(2, sums, 64);
      _tile_stored(3, sums + 256, 64);
      store_sums(sums, bias, out.panel_row(row0 + m0 + kTileRows, b), ldc, second_rows, cols,
                 out.silu_mul);
    }
  }
}

inline void amx_gemm(const at::BFloat16* a, int64_t lda, int64_t m, int64_t m_padded,
              const at::BFloat16* packed, int64_t blocks, int64_t pairs, const float* bias,
              const Output& out) {
  const int64_t panel_size = pairs * kPairsBlock * 2;
  // A region for each chunk of rows, its panels split between the threads the same way each
  // time, so a thread's panels pass by the chunk in its L2.
  for (int64_t r0 = 0; r0 < m_padded; r0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, m - r0);
    const int64_t rows_padded = std::min(kChunkRows, m_padded - r0);
    parallel_stealing(blocks, [&](StealingCursor& cursor) {
      __at_align__ float sums[2 * kTileRows * 16];
      load_tile_config();  // the tile state is each thread's own
      for (int64_t b = cursor.next(); b >= 0; b = cursor.next()) {
        amx_panel(a + r0 * lda, lda, rows, rows_padded, packed + b * panel_size, pairs,
                  bias != nullptr ? bias + b * kPairsBlock : nullptr, out, r0, b, sums);
      }
      _tile_release();
    });
  }
}

// Whether AMX takes these rows: enough of them, and k in whole tiles.
inline bool amx_takes(int64_t rows, int64_t pairs) {
  return rows >= kAmxMinRows && pairs % (kTileK / 2) == 0 && amx_permitted();
}

}  // namespace bf16_pairs
}  // namespace duoserve

#endif
