// Causal self-attention of prompt chunks that have no cached context, for CPU: all of a
// step's chunks in one call (float32 or bfloat16, computed in float32; head_dim a multiple
// of the key panel: 64 floats on AVX-512, 16 on AVX2 and NEON).
//
// torch's SDPA took one call per chunk per layer, and its flash kernel is slow at prompt
// sizes (16 chunks of 64-192 tokens: 8-9.5 ms per layer). Here every chunk's keys are laid
// out once, as panels of transposed keys, and its values as contiguous [keys x panel] panels
// (lay_out_chunks); then a task is (chunk, KV head, 64 query rows), handed out longest
// first, and for each query head of the KV head runs two small GEMMs through the
// register-tile kernel (gemm_tile.h):
// S = Q K^T, a causal softmax per row (scaled, max-subtracted, normalized), and O = P V.
// With a sliding window (window > 0), query i attends to keys (i - window, i] only: a task
// reads the keys from the panel holding its first row's window start, and masks the rest row
// by row.
//
// bfloat16 on AMX (attend_chunks_amx): both products as AMX tile products over bfloat16
// pairs instead, the softmax and roundings unchanged. 16 chunks of 128 tokens, SmolLM2's 9
// heads on 3 KV heads, one layer: 1.66-1.80 ms against 3.15-3.19 (processes alternating),
// outputs equal to torch's flash attention's as often (91%).

#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "gemm_tile.h"

namespace duoserve {
namespace {

constexpr int64_t kTaskRows = 64;  // query rows per task
// Vectors per K and V panel: 4 with 32 registers (a 6 x 4 tile); 2 with AVX2's 16, whose
// 2 x 4 tile ran slower than its 6 x 2 (a panel of 3 would not divide head_dim 64).
constexpr int kAttentionVectors = kVectorRegisters >= 32 ? 4 : 2;
constexpr int64_t kPanel = kAttentionVectors * kLanes;  // keys per K panel, columns per V panel

struct Task {
  int64_t chunk;
  int64_t kv_head;
  int64_t first_row;
};

// Row i of `scores` (query first_row + i; column j is key first_key + j) becomes its
// causal softmax over the keys up to the query, from its window's first key on:
// exp(scale s - max) / sum, and 0 for the others, up to `width`. With `inv_sums` (bfloat16
// inputs), the row keeps its numerators rounded to bfloat16 and inv_sums[i] gets 1 / sum of
// the unrounded ones, to apply after P V: how torch's flash attention computes in bfloat16,
// so the engine's bfloat16 outputs stay those of Hugging Face's SDPA. The numerators take
// ATen's vectorized exp (Sleef's, within 1 ulp): 16 chunks of 64-192 tokens of SmolLM2's
// heads in bfloat16, 1.57 ms a layer against 1.97-2.01 with a degree-7 polynomial within 2
// ulp (and 1.46-1.54 with ATen's exp_u20, within 20 ulp, which tipped more of the bench's
// near-ties away from Hugging Face's outputs: 36 of 64 equal, against 40 and 41 with Sleef's).
void causal_softmax(float* scores, int64_t rows, int64_t first_row, int64_t first_key,
                    int64_t width, int64_t window, float scale, float* inv_sums) {
  const fvec lowest(-std::numeric_limits<float>::infinity());
  const fvec scale_v(scale);
  for (int64_t i = 0; i < rows; ++i) {
    float* s = scores + i * width;
    const int64_t query = first_row + i;
    const int64_t keys = query - first_key + 1;
    if (window > 0) {  // keys before the window: -inf, so exp makes them 0
      const int64_t before = std::max<int64_t>(0, query - window + 1 - first_key);
      std::fill(s, s + before, -std::numeric_limits<float>::infinity());
    }
    fvec max_v = lowest;
    for (int64_t j = 0; j < keys; j += kLanes) {
      const int64_t count = std::min<int64_t>(kLanes, keys - j);
      const fvec scaled = fvec::loadu(s + j, count) * scale_v;
      max_v = at::vec::maximum(max_v, fvec::set(lowest, scaled, count));
    }
    const fvec max_score(reduce_max(max_v));
    fvec sum_v(0.0f);
    for (int64_t j = 0; j < width; j += kLanes) {
      const fvec e = (fvec::loadu(s + j) * scale_v - max_score).exp();
      const fvec kept = fvec::set(fvec(0.0f), e, std::clamp<int64_t>(keys - j, 0, kLanes));
      (inv_sums != nullptr ? round_to_bf16(kept) : kept).store(s + j);
      sum_v = sum_v + kept;
    }
    const float inv = 1.0f / reduce_add(sum_v);
    if (inv_sums != nullptr) {
      inv_sums[i] = inv;
      continue;
    }
    const fvec inv_v(inv);
    for (int64_t j = 0; j < width; j += kLanes) (fvec::loadu(s + j) * inv_v).store(s + j);
  }
}

// The tasks of a call, (chunk, KV head, kTaskRows query rows), longest first (a task's cost
// grows with its last row), so the last ones are short.
std::vector<Task> longest_first_tasks(const int32_t* len_ptr, int64_t num_chunks,
                                      int64_t kv_heads) {
  std::vector<Task> tasks;
  for (int64_t c = 0; c < num_chunks; ++c) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t row = 0; row < len_ptr[c]; row += kTaskRows) tasks.push_back({c, h, row});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    return std::min<int64_t>(a.first_row + kTaskRows, len_ptr[a.chunk]) >
           std::min<int64_t>(b.first_row + kTaskRows, len_ptr[b.chunk]);
  });
  return tasks;
}

// A task's query rows and the keys it reads: [first_key, first_row + rows), `width` of them
// rounded up to whole panels. Causal, no query here sees further; windowed, none sees further
// back than the first row's window (the keys before it in the first panel are masked by
// causal_softmax, their products 0).
struct TaskSpan {
  int64_t rows;
  int64_t first_key;
  int64_t width;
};

TaskSpan task_span(const Task& task, const int32_t* len_ptr, int64_t window) {
  const int64_t rows = std::min<int64_t>(kTaskRows, len_ptr[task.chunk] - task.first_row);
  const int64_t first_panel =
      window > 0 ? std::max<int64_t>(0, task.first_row - window + 1) / kPanel : 0;
  const int64_t first_key = first_panel * kPanel;
  const int64_t keys = task.first_row + rows - first_key;
  return {rows, first_key, (keys + kPanel - 1) / kPanel * kPanel};
}

// bfloat16 rows of P V's float32 sums: each times its 1 / sum, then rounded to nearest even
// as torch rounds, into out (rows out_stride elements apart).
void normalize_rows(float* result, int64_t rows, int64_t dim, const float* inv_sums,
                    at::BFloat16* out, int64_t out_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = result + i * dim;
    const fvec inv(inv_sums[i]);
    for (int64_t d = 0; d < dim; d += kLanes) (fvec::loadu(row + d) * inv).store(row + d);
    at::vec::convert(row, out + i * out_stride, dim);
  }
}

inline float widened(float x) { return x; }
inline float widened(at::BFloat16 x) { return static_cast<float>(x); }

// Every chunk's keys and values laid out once a call, for all the tasks that read them
// (before, each 64-row task laid out all the keys up to its rows again: 16 times the work
// for a 2,048-token prompt, 17% of its attention time): per (chunk, KV head), of elements
// E, for the chunk's length rounded up to whole panels (zeros past it). The float32 path's
// (ChunkLayouts): the keys as panels of transposed keys, [key panel][dim][kPanel keys], the
// values as [dim panel][key][kPanel].
template <typename E>
struct Layouts {
  std::vector<int64_t> offset;  // chunk c's first element in each of the two layouts
  std::vector<int64_t> width;   // chunk c's keys rounded up to whole panels
  E* keys = nullptr;
  E* values = nullptr;
  int64_t dim = 0;
  // The work of laying them out: (chunk, key panel), each for every KV head.
  std::vector<std::array<int64_t, 2>> units;

  // Sizes the layouts of k's chunks, in room kept by the calling thread from call to call
  // (a fresh allocation a call was handed back to the kernel by malloc and faulted in
  // again: ~870 page faults, half the time of a step's call for 15 short chunks).
  Layouts(const at::Tensor& k, const int32_t* len_ptr, int64_t num_chunks) : dim(k.size(2)) {
    int64_t total = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t chunk_width = (len_ptr[c] + kPanel - 1) / kPanel * kPanel;
      offset.push_back(total);
      width.push_back(chunk_width);
      total += k.size(1) * chunk_width * dim;
      for (int64_t panel = 0; panel < chunk_width / kPanel; ++panel) units.push_back({c, panel});
    }
    thread_local std::vector<E> room;
    if (static_cast<int64_t>(room.size()) < 2 * total) room.resize(2 * total);
    keys = room.data();
    values = room.data() + total;
  }

  E* keys_of(int64_t c, int64_t h) const { return keys + offset[c] + h * width[c] * dim; }
  E* values_of(int64_t c, int64_t h) const { return values + offset[c] + h * width[c] * dim; }
};
using ChunkLayouts = Layouts<float>;

template <typename T>
ChunkLayouts lay_out_chunks(const at::Tensor& k, const at::Tensor& v, const int32_t* start_ptr,
                            const int32_t* len_ptr, int64_t num_chunks) {
  ChunkLayouts layouts(k, len_ptr, num_chunks);
  const int64_t kv_heads = k.size(1), dim = layouts.dim;
  const auto& units = layouts.units;
  const T* k_ptr = k.data_ptr<T>();
  const T* v_ptr = v.data_ptr<T>();
  const int64_t dim_panels = dim / kPanel;
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const auto [c, panel] = units[u];
      const int64_t width = layouts.width[c];
      for (int64_t h = 0; h < kv_heads; ++h) {
        float* keys_t = layouts.keys_of(c, h) + panel * dim * kPanel;
        float* values = layouts.values_of(c, h);
        for (int64_t lane = 0; lane < kPanel; ++lane) {
          const int64_t key = panel * kPanel + lane;
          if (key >= len_ptr[c]) {  // padding: zeros, so padded products are 0
            for (int64_t d = 0; d < dim; ++d) keys_t[d * kPanel + lane] = 0.0f;
            for (int64_t p = 0; p < dim_panels; ++p) {
              std::fill_n(values + (p * width + key) * kPanel, kPanel, 0.0f);
            }
            continue;
          }
          const int64_t token = start_ptr[c] + key;
          const T* k_row = k_ptr + token * k.stride(0) + h * k.stride(1);
          const T* v_row = v_ptr + token * v.stride(0) + h * v.stride(1);
          for (int64_t d = 0; d < dim; ++d) keys_t[d * kPanel + lane] = widened(k_row[d]);
          for (int64_t p = 0; p < dim_panels; ++p) {
            float* dst = values + (p * width + key) * kPanel;
            if constexpr (std::is_same_v<T, float>) {
              std::copy_n(v_row + p * kPanel, kPanel, dst);
            } else {
              widen_bf16(v_row + p * kPanel, dst, kPanel);
            }
          }
        }
      }
    }
  });
  return layouts;
}

#if DUOSERVE_AMX_TILES

// bfloat16 with AMX: the same tasks, with S = Q K^T and O = P V as products of AMX's tiles
// over bfloat16 pairs, the query rows and P as they are (P's numerators are bfloat16 values
// already), sums in float32; the softmax and the roundings are the float32 path's. The
// layouts, per (chunk, KV head), for the chunk's keys rounded up to whole panels (zeros
// past them): keys as B tiles read them for Q K^T, [dim / 2][key][2] (a row of pairs of
// dimensions for 16 keys), values for P V, [key / 2][dim][2].
using PairLayouts = Layouts<at::BFloat16>;

// Two rows of `dim` bfloat16 values (null: zeros) as pairs, [dim][2], into out.
void interleave_rows(const at::BFloat16* first, const at::BFloat16* second, int64_t dim,
                     at::BFloat16* out) {
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

PairLayouts lay_out_pairs(const at::Tensor& k, const at::Tensor& v, const int32_t* start_ptr,
                          const int32_t* len_ptr, int64_t num_chunks) {
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
void tile_gemm(const at::BFloat16* a, int64_t lda, int64_t rows_padded, const at::BFloat16* b,
               int64_t b_row, int64_t cols, int64_t k, float* c, int64_t ldc) {
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
// bfloat16 (vec.h's store_bf16 keeps their high halves).
void narrow_exact(const float* src, int64_t rows, int64_t width, at::BFloat16* dst) {
  for (int64_t i = 0; i < rows * width; i += kLanes) store_bf16(fvec::loadu(src + i), dst + i);
}

void attend_chunks_amx(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const int32_t* start_ptr, const int32_t* len_ptr,
                       int64_t num_chunks, int64_t max_len, double scale, int64_t window) {
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

#endif  // DUOSERVE_AMX_TILES

// out, q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] (strided views, such
// as the fused qkv projection's); chunk i is tokens [starts[i], starts[i] + lens[i]). T is
// float or at::BFloat16: bfloat16 is widened as the keys, values and query rows are laid
// out and the math runs in float32, with P rounded to bfloat16 as torch's flash attention
// rounds it (causal_softmax) and each output row rounded once at the end.
template <typename T>
void attend_chunks(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const int32_t* start_ptr, const int32_t* len_ptr, int64_t num_chunks,
                   int64_t max_len, double scale, int64_t window) {
  constexpr bool kWiden = !std::is_same_v<T, float>;
  const int64_t heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  const ChunkLayouts layouts = lay_out_chunks<T>(k, v, start_ptr, len_ptr, num_chunks);
  const std::vector<Task> tasks = longest_first_tasks(len_ptr, num_chunks, kv_heads);
  const int64_t group = heads / kv_heads;
  const int64_t max_keys = (max_len + kPanel - 1) / kPanel * kPanel;
  const int64_t dim_panels = dim / kPanel;
  std::atomic<int64_t> next_task{0};
  const T* q_ptr = q.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores(kTaskRows * max_keys);  // [query row][key]
    // bfloat16: one query head's rows of the task, widened, and their float32 results.
    std::vector<float> query(kWiden ? kTaskRows * dim : 0);
    std::vector<float> result(kWiden ? kTaskRows * dim : 0);
    float inv_sums[kTaskRows];
    for (int64_t index = next_task++; index < static_cast<int64_t>(tasks.size());
         index = next_task++) {
      const Task& task = tasks[index];
      const int64_t start = start_ptr[task.chunk];
      const auto [rows, first_key, width] = task_span(task, len_ptr, window);
      const int64_t chunk_width = layouts.width[task.chunk];
      const float* keys_t = layouts.keys_of(task.chunk, task.kv_head) + first_key * dim;
      const float* values = layouts.values_of(task.chunk, task.kv_head) + first_key * kPanel;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = task.kv_head * group + g;
        const T* q_rows = q_ptr + (start + task.first_row) * q.stride(0) + head * q.stride(1);
        T* out_rows = out_ptr + (start + task.first_row) * out.stride(0) + head * out.stride(1);
        const float* a = nullptr;
        int64_t lda = 0, ldc = 0;
        float* c = nullptr;
        if constexpr (kWiden) {
          for (int64_t i = 0; i < rows; ++i) {
            widen_bf16(q_rows + i * q.stride(0), query.data() + i * dim, dim);
          }
          a = query.data(), lda = dim, c = result.data(), ldc = dim;
        } else {
          a = q_rows, lda = q.stride(0), c = out_rows, ldc = out.stride(0);
        }
        for (int64_t panel = 0; panel < width / kPanel; ++panel) {
          panel_rows<kAttentionVectors>(a, lda, rows, keys_t + panel * dim * kPanel, dim,
                                        nullptr, scores.data() + panel * kPanel, width, kPanel,
                                        nullptr);
        }
        causal_softmax(scores.data(), rows, task.first_row, first_key, width, window,
                       static_cast<float>(scale), kWiden ? inv_sums : nullptr);
        for (int64_t panel = 0; panel < dim_panels; ++panel) {
          panel_rows<kAttentionVectors>(scores.data(), width, rows,
                                        values + panel * chunk_width * kPanel, width, nullptr,
                                        c + panel * kPanel, ldc, kPanel, nullptr);
        }
        if constexpr (kWiden) {
          normalize_rows(result.data(), rows, dim, inv_sums, out_rows, out.stride(0));
        }
      }
    }
  });
}

void prefill_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& starts, const at::Tensor& lens,
                        double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.sizes() == q.sizes(),
              "prefill_attention: q and out must be [tokens, heads, head_dim], k and v "
              "[tokens, kv_heads, head_dim]");
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k.scalar_type() == dtype &&
                  v.scalar_type() == dtype && out.scalar_type() == dtype,
              "prefill_attention: q, k, v and out must all be float32 or all bfloat16");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "prefill_attention: head_dim must be contiguous");
  const int64_t heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == dim && k.size(0) == q.size(0) &&
                  heads % kv_heads == 0,
              "prefill_attention: k and v must match q's tokens and head_dim");
  TORCH_CHECK(dim % kPanel == 0, "prefill_attention: head_dim must be a multiple of ", kPanel,
              " in this build");
  TORCH_CHECK(starts.scalar_type() == at::kInt && lens.scalar_type() == at::kInt &&
                  starts.is_contiguous() && lens.is_contiguous() &&
                  starts.numel() == lens.numel(),
              "prefill_attention: starts and lens must be contiguous int32 of one length");
  TORCH_CHECK(window >= 0, "prefill_attention: window must be 0 (none) or positive");
  const int32_t* start_ptr = starts.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  int64_t max_len = 0;
  for (int64_t c = 0; c < starts.numel(); ++c) {
    TORCH_CHECK(start_ptr[c] >= 0 && len_ptr[c] >= 1 && start_ptr[c] + len_ptr[c] <= q.size(0),
                "prefill_attention: chunk ", c, " is out of range");
    max_len = std::max<int64_t>(max_len, len_ptr[c]);
  }
  if (dtype == at::kFloat) {
    attend_chunks<float>(out, q, k, v, start_ptr, len_ptr, starts.numel(), max_len, scale, window);
  } else {
#if DUOSERVE_AMX_TILES
    if (dim % kTileK == 0 && amx_permitted()) {
      attend_chunks_amx(out, q, k, v, start_ptr, len_ptr, starts.numel(), max_len, scale,
                        window);
      return;
    }
#endif
    attend_chunks<at::BFloat16>(out, q, k, v, start_ptr, len_ptr, starts.numel(), max_len, scale,
                                window);
  }
}

int64_t prefill_attention_panel() { return kPanel; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def("prefill_attention_panel() -> int", &prefill_attention_panel);
  m.def(
      "prefill_attention_(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor starts, "
      "Tensor lens, float scale, int window=0) -> ()");
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) { m.impl("prefill_attention_", &prefill_attention_); }

}  // namespace duoserve
