// What prefill_attention.cpp's two paths share (float32 on the register tile, bfloat16 on
// AMX's tiles): the tasks, (chunk, KV head, kTaskRows query rows) longest first, the keys each
// reads, the causal softmax with torch's roundings, and the room the chunks are laid out in.
#pragma once

#include "vec.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <vector>

namespace duoserve::prefill {

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
inline void causal_softmax(float* scores, int64_t rows, int64_t first_row, int64_t first_key,
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
inline std::vector<Task> longest_first_tasks(const int32_t* len_ptr, int64_t num_chunks,
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

inline TaskSpan task_span(const Task& task, const int32_t* len_ptr, int64_t window) {
  const int64_t rows = std::min<int64_t>(kTaskRows, len_ptr[task.chunk] - task.first_row);
  const int64_t first_panel =
      window > 0 ? std::max<int64_t>(0, task.first_row - window + 1) / kPanel : 0;
  const int64_t first_key = first_panel * kPanel;
  const int64_t keys = task.first_row + rows - first_key;
  return {rows, first_key, (keys + kPanel - 1) / kPanel * kPanel};
}

// bfloat16 rows of P V's float32 sums: each times its 1 / sum, then rounded to nearest even
// as torch rounds, into out (rows out_stride elements apart).
inline void normalize_rows(float* result, int64_t rows, int64_t dim, const float* inv_sums,
                           at::BFloat16* out, int64_t out_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = result + i * dim;
    const fvec inv(inv_sums[i]);
    for (int64_t d = 0; d < dim; d += kLanes) (fvec::loadu(row + d) * inv).store(row + d);
    at::vec::convert(row, out + i * out_stride, dim);
  }
}

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

}  // namespace duoserve::prefill
