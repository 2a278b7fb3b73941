// prefill_attention.cpp's bfloat16 path on AMX's tiles (attend_chunks_amx), where the build
// has them.
#pragma once

#include "vec.h"

#if DUOSERVE_AMX_TILES

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "prefill_tasks.h"

namespace duoserve::prefill {

// bfloat16 with AMX: the same tasks, with S = Q K^T and O = P V as products of AMX's tiles
// over bfloat16 pairs, the query rows and P as they are (P's numerators are bfloat16 values
// already), sums in float32; the softmax and the roundings are the float32 path's. The
// layouts, per (chunk, KV head), for the chunk's keys rounded up to whole panels (zeros
// past them): keys as B tiles read them for Q K^T, [dim / 2][key][2] (a row of pairs of
// dimensions for 16 keys), values for P V, [key / 2][dim][2].
using PairLayouts = Layouts<at::BFloat16>;

// Two rows of `dim` bfloat16 values (null: zeros) as pairs, [dim][2], into out.
inline void interleave_rows(const at::BFloat16* first, const at::BFloat16* second,
                            int64_t dim, at::BFloat16* out) {
  // Lanes 2i and 2i + 1 of a result: element i of the first source and of the second (the
  // low 16 of each), or 16 + i of each.
  alignas(64) static const std::array<int16_t, 32> kLow = [] {
    std::array<int16_t, 32> index{};
    for (int i = 0; i < 16; ++i) index[2 * i] = i, index[2 * i + 1] = 32 + i;
    return index;
  }();
  alignas(64) static const std::array<int16_t, 32> kHigh = [] {
    std::array<int16_t, 32> index{};
    for (int i = 0; i < 16; ++i) index[2 * i] = 16 + i, index[2 * i + 1] = 48 + i;
    return index;
  }();
  const __m512i low = _mm512_load_si512(kLow.data()), high = _mm512_load_si512(kHigh.data());
  for (int64_t d = 0; d < dim; d += 32) {
    const __m512i a = first != nullptr ? _mm512_loadu_si512(first + d) : _mm512_setzero_si512();
    const __m512i b = second != nullptr ? _mm512_loadu_si512(second + d) : _mm512_setzero_si512();
    _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(a, low, b));
    _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(a, high, b));
  }
}

inline PairLayouts lay_out_pairs(const at::Tensor& k, const at::Tensor& v,
                                 const int32_t* start_ptr, const int32_t* len_ptr,
                                 int64_t num_chunks) {
  PairLayouts layouts(k, len_ptr, num_chunks);
  const int64_t kv_heads = k.size(1), dim = layouts.dim;
  const auto& units = layouts.units;
  const at::BFloat16* k_ptr = k.data_ptr<at::BFloat16>();
  const at::BFloat16* v_ptr = v.data_ptr<at::BFloat16>();
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const auto [c, panel] = units[u];
      const int64_t width = layouts.width[c];
      for (int64_t h = 0; h < kv_heads; ++h) {
        // A pair of dimensions of a key is 4 bytes: copied as one int32.
        int32_t* keys = reinterpret_cast<int32_t*>(layouts.keys_of(c, h));
        at::BFloat16* values = layouts.values_of(c, h);
        auto row_of = [&](const at::Tensor& t, const at::BFloat16* data, int64_t key) {
          return key < len_ptr[c] ? data + (start_ptr[c] + key) * t.stride(0) + h * t.stride(1)
                                  : nullptr;  // padding: zeros, so padded products are 0
        };
        for (int64_t key = panel * kPanel; key < (panel + 1) * kPanel; key += 2) {
          for (int64_t j = key; j < key + 2; ++j) {
            const at::BFloat16* k_row = row_of(k, k_ptr, j);
            for (int64_t d = 0; d < dim / 2; ++d) {
              if (k_row == nullptr) {
                keys[d * width + j] = 0;
              } else {
                std::memcpy(keys + d * width + j, k_row + 2 * d, sizeof(int32_t));
              }
            }
          }
          interleave_rows(row_of(v, v_ptr, key), row_of(v, v_ptr, key + 1), dim,
                          values + key * dim);
        }
      }
    }
  });
  return layouts;
}

// c[rows_padded x cols] (float32, ldc floats) = a[rows_padded x k] (bfloat16, lda elements)
// times the B tiles of b (pairs layout: k / 2 rows of `b_row` elements, the columns' pairs
// starting at b), rows_padded a multiple of 16 and cols of 32, k of 32: two row tiles by
// two column tiles at a time.
inline void tile_gemm(const at::BFloat16* a, int64_t lda, int64_t rows_padded,
                      const at::BFloat16* b, int64_t b_row, int64_t cols, int64_t k, float* c,
                      int64_t ldc) {
  const int64_t a_stride = lda * 2, b_stride = b_row * 2, c_stride = ldc * 4;
  for (int64_t m0 = 0; m0 < rows_padded; m0 += 2 * kTileRows) {
    const bool second = m0 + kTileRows < rows_padded;
    for (int64_t n0 = 0; n0 < cols; n0 += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
        const at::BFloat16* b_tiles = b + (k0 / 2) * b_row + 2 * n0;
        _tile_loadd(6, b_tiles, b_stride);
        _tile_loadd(7, b_tiles + 32, b_stride);
        _tile_loadd(4, a + m0 * lda + k0, a_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (second) {
          _tile_loadd(5, a + (m0 + kTileRows) * lda + k0, a_stride);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* out = c + m0 * ldc + n0;
      _tile_stored(0, out, c_stride);
      _tile_stored(1, out + 16, c_stride);
      if (second) {
        _tile_stored(2, out + kTileRows * ldc, c_stride);
        _tile_stored(3, out + kTileRows * ldc + 16, c_stride);
      }
    }
  }
}

// rows x width float32 values that are bfloat16 already (P's rounded numerators), as
// bfloat16 (vec_bf16.h's store_bf16 keeps their high halves).
inline void narrow_exact(const float* src, int64_t rows, int64_t width, at::BFloat16* dst) {
  for (int64_t i = 0; i < rows * width; i += kLanes) store_bf16(fvec::loadu(src + i), dst + i);
}

inline void attend_chunks_amx(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const int32_t* start_ptr,
                              const int32_t* len_ptr, int64_t num_chunks, int64_t max_len,
                              double scale, int64_t window) {
  const int64_t heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  const PairLayouts layouts = lay_out_pairs(k, v, start_ptr, len_ptr, num_chunks);
  const std::vector<Task> tasks = longest_first_tasks(len_ptr, num_chunks, kv_heads);
  const int64_t group = heads / kv_heads;
  const int64_t max_keys = (max_len + kPanel - 1) / kPanel * kPanel;
  std::atomic<int64_t> next_task{0};
  const at::BFloat16* q_ptr = q.data_ptr<at::BFloat16>();
  at::BFloat16* out_ptr = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores(kTaskRows * max_keys);                // [query row][key]
    std::vector<at::BFloat16> numerators(kTaskRows * max_keys);     // P, as A tiles read it
    std::vector<at::BFloat16> query(kTaskRows * dim);               // rows past the task's: 0
    std::vector<float> result(kTaskRows * dim);
    float inv_sums[kTaskRows];
    load_tile_config();
    for (int64_t index = next_task++; index < static_cast<int64_t>(tasks.size());
         index = next_task++) {
      const Task& task = tasks[index];
      const int64_t start = start_ptr[task.chunk];
      const auto [rows, first_key, width] = task_span(task, len_ptr, window);
      const int64_t rows_padded = (rows + kTileRows - 1) / kTileRows * kTileRows;
      const int64_t chunk_width = layouts.width[task.chunk];
      const at::BFloat16* key_pairs = layouts.keys_of(task.chunk, task.kv_head) + 2 * first_key;
      const at::BFloat16* value_pairs =
          layouts.values_of(task.chunk, task.kv_head) + first_key * dim;
      std::fill(query.begin() + rows * dim, query.begin() + rows_padded * dim,
                at::BFloat16(0.0f));
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = task.kv_head * group + g;
        const at::BFloat16* q_rows =
            q_ptr + (start + task.first_row) * q.stride(0) + head * q.stride(1);
        at::BFloat16* out_rows =
            out_ptr + (start + task.first_row) * out.stride(0) + head * out.stride(1);
        for (int64_t i = 0; i < rows; ++i) {
          std::copy_n(q_rows + i * q.stride(0), dim, query.data() + i * dim);
        }
        tile_gemm(query.data(), dim, rows_padded, key_pairs, 2 * chunk_width, width, dim,
                  scores.data(), width);
        causal_softmax(scores.data(), rows, task.first_row, first_key, width, window,
                       static_cast<float>(scale), inv_sums);
        narrow_exact(scores.data(), rows, width, numerators.data());
        std::fill(numerators.begin() + rows * width, numerators.begin() + rows_padded * width,
                  at::BFloat16(0.0f));
        tile_gemm(numerators.data(), width, rows_padded, value_pairs, 2 * dim, dim, width,
                  result.data(), dim);
        normalize_rows(result.data(), rows, dim, inv_sums, out_rows, out.stride(0));
      }
    }
    _tile_release();
  });
}

}  // namespace duoserve::prefill

#endif  // DUOSERVE_AMX_TILES
