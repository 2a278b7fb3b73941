// Decode attention straight from the paged KV cache, for CPU.
//
// One query token per sequence attends to its first context_lens[s] cached tokens, found
// through its block table: no gather into a padded copy, no mask over padding. With a
// sliding window (window > 0), to the last `window` of them only: the blocks before are not
// read (they may have been released and handed to another request). Work is split over
// sequences (or (sequence, KV head) pairs when there are few) on torch's intra-op thread
// pool; the query heads that share a KV head read each K/V row once, together. A sequence's
// task loads its rows into cache before its passes where they fit (paged_rows.h).
//
// Math is in float32 whatever the cache dtype: scores = q.k * scale, a max-subtracted
// softmax over the context, then the probability-weighted sum of V.

#include "paged_attention_vec.h"
#include "paged_rows.h"
#include "vec.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>


namespace duoserve {
namespace {

struct Shape {
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t max_blocks;     // block table width
  int64_t q_row_stride;   // elements between two sequences' queries
  int64_t q_head_stride;  // elements between two heads of one query
  int64_t out_row_stride;
};

// The scalar path, for head sizes and dtypes the vector path (paged_attention_vec.h) has no
// code for: a task's KV heads [kv_begin, kv_end) and their query heads.
template <typename scalar_t>
void attend_one(const scalar_t* __restrict q, const scalar_t* __restrict k_cache,
                const scalar_t* __restrict v_cache, const TokenRows& rows, int64_t kv_begin,
                int64_t kv_end, const Shape& shape, float scale, scalar_t* __restrict out,
                std::vector<float>& query, std::vector<float>& scores, std::vector<float>& acc) {
  // The query heads of KV heads [kv_begin, kv_end): `per_kv` per KV head, consecutive.
  const int64_t per_kv = shape.num_heads / shape.num_kv_heads;
  const int64_t group = (kv_end - kv_begin) * per_kv;
  const int64_t dim = shape.head_dim;
  const int64_t first_head = kv_begin * per_kv;
  const int64_t span = (kv_end - kv_begin) * dim;
  const int64_t len = rows.count;
  k_cache += kv_begin * dim;
  v_cache += kv_begin * dim;

  for (int64_t g = 0; g < group; ++g) {
    const scalar_t* src = q + (first_head + g) * shape.q_head_stride;
    for (int64_t d = 0; d < dim; ++d) query[g * dim + d] = static_cast<float>(src[d]);
  }

  // Scores.
  const int64_t num_kv = kv_end - kv_begin;
  for_each_row(k_cache, rows, true, span, [&](int64_t t, const scalar_t* __restrict key_row) {
    for (int64_t h = 0; h < num_kv; ++h) {
      const scalar_t* key = key_row + h * dim;
      for (int64_t g = h * per_kv; g < (h + 1) * per_kv; ++g) {
        const float* qg = query.data() + g * dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qg[d] * static_cast<float>(key[d]);
        scores[g * len + t] = dot * scale;
      }
    }
  });

  // Softmax per query head; keep 1 / sum for the end.
  std::vector<float> inv_sum(group);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * len;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) max_score = std::max(max_score, s[t]);
    float sum = 0.0f;
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - max_score);
      sum += s[t];
    }
    inv_sum[g] = 1.0f / sum;
  }

  // Probability-weighted sum of V.
  std::fill(acc.begin(), acc.begin() + group * dim, 0.0f);
  for_each_row(v_cache, rows, true, span, [&](int64_t t, const scalar_t* __restrict value_row) {
    for (int64_t h = 0; h < num_kv; ++h) {
      const scalar_t* value = value_row + h * dim;
      for (int64_t g = h * per_kv; g < (h + 1) * per_kv; ++g) {
        const float p = scores[g * len + t];
        float* a = acc.data() + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += p * static_cast<float>(value[d]);
      }
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    scalar_t* dst = out + (first_head + g) * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * dim + d] * inv_sum[g]);
  }
}



at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, int64_t max_context_len,
                                  double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3, "q must be [seqs, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.stride(2) == 1, "q's head_dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == q.size(0),
              "block_tables must be contiguous int32 [seqs, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0),
              "context_lens must be contiguous int32 [seqs]");
  const Shape shape{q.size(1),         k_cache.size(2),   k_cache.size(3), k_cache.size(1),
                    block_tables.size(1), q.stride(0),    q.stride(1),     q.size(1) * q.size(2)};
  TORCH_CHECK(q.size(2) == shape.head_dim, "q and the caches differ in head_dim");
  TORCH_CHECK(shape.num_heads % shape.num_kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");

  const int64_t num_seqs = q.size(0);
  const int64_t row = shape.num_kv_heads * shape.head_dim;  // elements in one token's cache row
  auto out = at::empty({num_seqs, shape.num_heads, shape.head_dim}, q.options());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  auto first_token = [&](int64_t s) -> int64_t {
    return window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0;
  };
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_context_len &&
                    lens[s] <= shape.max_blocks * shape.block_size,
                "context_lens[", s, "] = ", lens[s], " is out of range");
  }
  // Many sequences: one task each, reading whole cache rows (every KV head) in order.
  // Few (a lone request): one task per (sequence, KV head), so every thread has work.
  const int64_t kv_per_task =
      num_seqs >= 4 * at::get_num_threads() ? shape.num_kv_heads : 1;
  const int64_t tasks_per_seq = shape.num_kv_heads / kv_per_task;
  const int64_t heads_per_task = kv_per_task * (shape.num_heads / shape.num_kv_heads);

  // Tasks are handed out one at a time: sequences differ in length, and a static split
  // left one thread idle while the other finished the longer half.
  const int64_t num_tasks = num_seqs * tasks_per_seq;
  const int64_t padded_context = (max_context_len + kLanes - 1) / kLanes * kLanes;
  std::atomic<int64_t> next_task{0};
  auto run_vector_path = [&](auto* type_tag) -> bool {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    const decode_vec::AttendFn<T> attend = decode_vec::attend_fn<T>(shape.head_dim);
    if (attend == nullptr) return false;
    const T* q_ptr = q.data_ptr<T>();
    const T* k_ptr = k_cache.data_ptr<T>();
    const T* v_ptr = v_cache.data_ptr<T>();
    T* out_ptr = out.data_ptr<T>();
    const int64_t per_kv = shape.num_heads / shape.num_kv_heads;
    // Whole-sequence tasks load their rows first where they fit (paged_rows.h).
    const bool whole_rows = kv_per_task == shape.num_kv_heads;
    const int64_t max_loaded_tokens =
        kLoadedRowsPerL2 * l2_cache_bytes() / (2 * row * static_cast<int64_t>(sizeof(T)));
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      // The thread's room, kept between calls (every layer of every step calls): scores for
      // the heads one KV head's pass takes, V sums, row offsets. Every score read is written
      // first (a chunk's padding lanes as 0), so nothing is cleared.
      thread_local std::vector<float> scores;
      thread_local std::vector<float> acc;
      thread_local std::vector<int64_t> offsets;
      const int64_t score_heads = std::min<int64_t>(per_kv, decode_vec::kMaxHeads);
      if (static_cast<int64_t>(scores.size()) < score_heads * padded_context) {
        scores.resize(score_heads * padded_context);
      }
      if (static_cast<int64_t>(acc.size()) < score_heads * shape.head_dim) {
        acc.resize(score_heads * shape.head_dim);
      }
      for (int64_t task = next_task++; task < num_tasks; task = next_task++) {
        const int64_t s = task / tasks_per_seq;
        const int64_t kv_begin = (task % tasks_per_seq) * kv_per_task;
        const TokenRows rows = locate_rows(tables + s * shape.max_blocks, first_token(s), lens[s],
                                           shape.block_size, row, offsets);
        const bool loaded = whole_rows && rows.count <= max_loaded_tokens;
        if (loaded) load_rows(k_ptr, v_ptr, rows, row);
        for (int64_t h = kv_begin; h < kv_begin + kv_per_task; ++h) {
          const T* q_head = q_ptr + s * shape.q_row_stride + h * per_kv * shape.q_head_stride;
          T* out_head = out_ptr + s * shape.out_row_stride + h * per_kv * shape.head_dim;
          attend(q_head, shape.q_head_stride, k_ptr + h * shape.head_dim,
                 v_ptr + h * shape.head_dim, rows, static_cast<float>(scale), out_head,
                 scores.data(), acc.data(), per_kv, !loaded);
        }
      }
    });
    return true;
  };
  if (q.scalar_type() == at::kFloat && run_vector_path(static_cast<float*>(nullptr))) return out;
  if (q.scalar_type() == at::kBFloat16 && run_vector_path(static_cast<at::BFloat16*>(nullptr))) {
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
        const scalar_t* q_ptr = q.data_ptr<scalar_t>();
        const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
        const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
        scalar_t* out_ptr = out.data_ptr<scalar_t>();
        at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
          std::vector<float> query(heads_per_task * shape.head_dim);
          std::vector<float> scores(heads_per_task * max_context_len);
          std::vector<float> acc(heads_per_task * shape.head_dim);
          std::vector<int64_t> offsets;
          for (int64_t task = next_task++; task < num_tasks; task = next_task++) {
            const int64_t s = task / tasks_per_seq;
            const int64_t kv_begin = (task % tasks_per_seq) * kv_per_task;
            const TokenRows rows = locate_rows(tables + s * shape.max_blocks, first_token(s),
                                               lens[s], shape.block_size, row, offsets);
            attend_one<scalar_t>(q_ptr + s * shape.q_row_stride, k_ptr, v_ptr, rows, kv_begin,
                                 kv_begin + kv_per_task, shape, static_cast<float>(scale),
                                 out_ptr + s * shape.out_row_stride, query, scores, acc);
          }
        });
      });
  return out;
}

}  // namespace

TORCH_LIBRARY(duoserve, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, int max_context_len, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }

}  // namespace duoserve
