// Decode attention straight from the paged KV cache, for CPU.
//
// One query token per sequence attends to its first context_lens[s] cached tokens, found
// through its block table: no gather into a padded copy, no mask over padding. With a
// sliding window (window > 0), to the last `window` of them only: the blocks before are not
// read (they may have been released and handed to another request). Work is split over
// sequences (or (sequence, KV head) pairs when there are few) on torch's intra-op thread
// pool; the query heads that share a KV head read each K/V row once, together.
//
// Math is in float32 whatever the cache dtype: scores = q.k * scale, a max-subtracted
// softmax over the context, then the probability-weighted sum of V.

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

// Where a sequence's cached tokens start in the caches, in elements from the cache's first
// row (the K and V caches share the layout): token first + i's row at offsets[i], for
// tokens [first, context_len). Found once a sequence, through its block table, for every
// pass over K and V of all its KV heads: stepping a cursor through the table in each pass
// cost about as much as the pass's dot products.
struct TokenRows {
  const int64_t* offsets;
  int64_t count;
};

TokenRows locate_rows(const int32_t* table, int64_t first, int64_t context_len,
                      int64_t block_size, int64_t row, std::vector<int64_t>& offsets) {
  const int64_t count = std::max<int64_t>(context_len - first, 0);
  offsets.resize(count);
  int64_t i = 0;
  for (int64_t block = first / block_size; i < count; ++block) {
    const int64_t base = static_cast<int64_t>(table[block]) * block_size;
    for (int64_t slot = (first + i) % block_size; slot < block_size && i < count; ++slot) {
      offsets[i++] = (base + slot) * row;
    }
  }
  return {offsets.data(), count};
}

// Each step of a first pass over a cache prefetches the row kLeadTokens ahead: the hardware
// prefetchers do not follow the block table. Before, entering a block prefetched all of the
// next block's rows at once, and perf still showed the loads of K and V rows stalling for
// most of the kernel's time; one row a step ran 1.4x faster at 64 sequences and 1.6x at one
// (the Xeon with AMX, bfloat16). 40 tokens ahead: on the Zen 5, 64 bfloat16 sequences of
// 130-300 tokens (30 layers of SmolLM2's heads) took 8.0-8.4 ms against 16 tokens' 11.1-11.2
// (300: 16.4 vs 23.0); float32, and one sequence, unchanged. On the Xeon, 8 (into L2) to 32
// measured alike. Later passes over the same rows (other query heads) find them in L2.
// Into L2, not L1 (prefetcht1, not prefetcht0): a core has few L1 misses in flight and the
// prefetched rows held them. On a Zen 4 VM (AMD EPYC family 25 model 17), the same 30 layers
// of 64 sequences (blocks in random order) took 17.8 ms against 27.6-28.5 into L1 (bfloat16;
// float32 32-33 against 45-47; the x86-64-v3 build 23.7 against 34.3; one thread 34-35
// against 54-55), and a bfloat16 batch's decode forward 55-56 ms a step against 61. Leads of
// 20, 80 and 160 tokens were slower into L2 than 40.
// Also measured no faster on the Xeon with AMX (64 sequences of 132-310 tokens, 30 layers,
// 21-23 ms from memory against 13-14 with one layer's rows in cache): a task's first 40 rows
// of K and V, every KV head's, requested when it starts, and with them the next task's
// (claimed a task ahead); the scores on AMX's tiles (a block's 16 key rows an A tile as they
// lie, the query heads a B tile: 1 ms faster for 30 layers in cache, none from memory).
constexpr int64_t kLeadTokens = 40;

// The rows of a task's tokens in order, `span` elements each (kSpan when known at compile
// time, so the prefetches unroll), from `cache` (offset to the task's KV head).
template <typename scalar_t, int64_t kSpan = 0>
class RowReader {
 public:
  RowReader(const scalar_t* cache, const TokenRows& rows, bool prefetch, int64_t span = kSpan)
      : cache_(cache), offsets_(rows.offsets), count_(rows.count), lines_(lines_of(span)),
        prefetch_(prefetch) {
    if (!prefetch_) return;
    for (int64_t i = 0; i < std::min(kLeadTokens, count_); ++i) prefetch_row(i);
  }

  __attribute__((always_inline)) const scalar_t* next() {
    if (prefetch_ && next_ + kLeadTokens < count_) prefetch_row(next_ + kLeadTokens);
    return cache_ + offsets_[next_++];
  }

 private:
  static constexpr int64_t lines_of(int64_t span) {
    return (span * static_cast<int64_t>(sizeof(scalar_t)) + 63) / 64;
  }

  __attribute__((always_inline)) void prefetch_row(int64_t i) const {
    const char* row = reinterpret_cast<const char*>(cache_ + offsets_[i]);
    if constexpr (kSpan > 0) {
      for (int64_t line = 0; line < lines_of(kSpan); ++line) prefetch_l2(row + 64 * line);
    } else {
      for (int64_t line = 0; line < lines_; ++line) prefetch_l2(row + 64 * line);
    }
  }

  const scalar_t* cache_;
  const int64_t* offsets_;
  int64_t count_;
  int64_t lines_;
  bool prefetch_;
  int64_t next_ = 0;
};

// Calls visit(i, token i's row) for the task's tokens, in order.
template <typename scalar_t, int64_t kSpan = 0, typename Visit>
__attribute__((always_inline)) inline void for_each_row(const scalar_t* cache,
                                                        const TokenRows& rows, bool prefetch,
                                                        int64_t span, Visit&& visit) {
  RowReader<scalar_t, kSpan> reader(cache, rows, prefetch, span);
  for (int64_t i = 0; i < rows.count; ++i) visit(i, reader.next());
}

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


// The vector path on Vectorized<float> (vec.h), for float32 and bfloat16 caches (bfloat16
// rows widened to float32 as they are loaded; the math in float32 either way) and the head
// sizes below (compile-time widths, so the accumulators can live in registers). Per KV head,
// `kGroup` query heads at a time:
// - scores kLanes tokens at a time: each token's dot product folds into one vector, and
//   one transpose-and-add tree turns the kLanes vectors into the kLanes scores (in place
//   of kLanes horizontal sums);
// - softmax with the vectorized exp of vec.h;
// - the weighted sum of V with the query heads' accumulators in registers.
namespace decode_vec {

inline vreg load_float(const float* p) { return fvec::loadu(p); }
inline vreg load_float(const at::BFloat16* p) { return load_bf16(p); }

inline void store_as(fvec v, float* p) { v.store(p); }
inline void store_as(fvec v, at::BFloat16* p) {  // rounded to nearest even, as torch rounds
  __at_align__ float lanes[kLanes];
  v.store(lanes);
  at::vec::convert(lanes, p, kLanes);
}

// The scores q.k * scale of `heads` query heads (kGroup at a time, `heads` a multiple of it)
// over the task's keys, kLanes tokens at a time: each token's dot product folds into one
// vector, and one transpose-and-add tree turns kLanes of them into kLanes scores. In
// float32; bfloat16 keys read by several query heads are widened once per chunk, into
// `widened`, for all of them (not once per query head). Each chunk's keys serve every group
// from L1 before the next chunk is read.
template <int kDim, int kGroup, typename T>
void float_scores(const T* __restrict q, int64_t q_head_stride, const T* __restrict k_cache,
                  const TokenRows& rows, bool prefetch, float scale, float* __restrict scores,
                  int64_t padded, int64_t heads) {
  constexpr int kVecs = kDim / kLanes;
  const int64_t len = rows.count;
  constexpr bool kBf16 = !std::is_same_v<T, float>;
  const bool widen = kBf16 && heads > 1;
  RowReader<T, kDim> keys(k_cache, rows, prefetch);
  const T* chunk_rows[kLanes];
  __at_align__ float widened[kBf16 ? kLanes * kDim : 1];
  for (int64_t start = 0; start < len; start += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, len - start);
    for (int64_t t = 0; t < count; ++t) {
      chunk_rows[t] = keys.next();
      if (widen) {
        for (int i = 0; i < kVecs; ++i) {
          fvec(load_float(chunk_rows[t] + kLanes * i)).store(widened + t * kDim + kLanes * i);
        }
      }
    }
    for (int64_t g0 = 0; g0 < heads; g0 += kGroup) {
      vreg query[kGroup][kVecs];  // scaled, so the dot products are the scores
      for (int g = 0; g < kGroup; ++g) {
        for (int i = 0; i < kVecs; ++i) {
          query[g][i] =
              fvec(load_float(q + (g0 + g) * q_head_stride + kLanes * i)) * fvec(scale);
        }
      }
      for (int g = 0; g < kGroup; ++g) {
        vreg dots[kLanes];
        for (int64_t t = 0; t < kLanes; ++t) {
          if (t >= count) {
            dots[t] = fvec(0.0f);
            continue;
          }
          if (widen) {
            const float* key = widened + t * kDim;
            vreg sum = fvec(query[g][0]) * fvec(load_float(key));
            for (int i = 1; i < kVecs; ++i) {
              sum = fmadd(query[g][i], load_float(key + kLanes * i), sum);
            }
            dots[t] = sum;
          } else {
            const T* key = chunk_rows[t];
            vreg sum = fvec(query[g][0]) * fvec(load_float(key));
            for (int i = 1; i < kVecs; ++i) {
              sum = fmadd(query[g][i], load_float(key + kLanes * i), sum);
            }
            dots[t] = sum;
          }
        }
        transpose_sum(dots).store(scores + (g0 + g) * padded + start);
      }
    }
  }
}

// With AVX512-BF16 (vec.h's kBf16DotProducts), the same scores from bfloat16 pairs:
// vdpbf16ps multiplies 32 bfloat16 keys by the query's and adds the products (exact in
// float32) pairwise into 16 float32 sums, with no widening of the keys; the scale after the
// sum. The sums run in another order than the float32 path's.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)

template <int kDim, int kGroup>
void bf16_dot_scores(const at::BFloat16* __restrict q, int64_t q_head_stride,
                     const at::BFloat16* __restrict k_cache, const TokenRows& rows, bool prefetch,
                     float scale, float* __restrict scores, int64_t padded) {
  constexpr int kPairs = kDim / 32;  // 32 bfloat16 values a vector
  const int64_t len = rows.count;
  __m512bh query[kGroup][kPairs];
  for (int g = 0; g < kGroup; ++g) {
    for (int i = 0; i < kPairs; ++i) {
      query[g][i] = (__m512bh)_mm512_loadu_si512(q + g * q_head_stride + 32 * i);
    }
  }
  RowReader<at::BFloat16, kDim> keys(k_cache, rows, prefetch);
  const at::BFloat16* chunk_rows[kLanes];
  const fvec scale_v(scale);
  for (int64_t start = 0; start < len; start += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, len - start);
    for (int64_t t = 0; t < count; ++t) chunk_rows[t] = keys.next();
    for (int g = 0; g < kGroup; ++g) {
      vreg dots[kLanes];
      for (int64_t t = 0; t < kLanes; ++t) {
        __m512 sum = _mm512_setzero_ps();
        if (t < count) {
          for (int i = 0; i < kPairs; ++i) {
            sum = _mm512_dpbf16_ps(sum, query[g][i],
                                   (__m512bh)_mm512_loadu_si512(chunk_rows[t] + 32 * i));
          }
        }
        dots[t] = sum;
      }
      (transpose_sum(dots) * scale_v).store(scores + g * padded + start);
    }
  }
}
#else
template <int kDim, int kGroup>
void bf16_dot_scores(const at::BFloat16*, int64_t, const at::BFloat16*, const TokenRows&, bool,
                     float, float*, int64_t) {}
#endif

// Softmax numerators of one query head's scores in place (the padding past `len` becomes
// 0); returns 1 / their sum.
template <typename T>
float softmax_numerators(float* __restrict s, int64_t len, int64_t padded) {
  const fvec lowest(-std::numeric_limits<float>::infinity());
  fvec max_v = lowest;
  for (int64_t t = 0; t < padded; t += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, len - t);
    max_v = at::vec::maximum(max_v, fvec::set(lowest, fvec::loadu(s + t), count));
  }
  const fvec max_score(reduce_max(max_v));
  fvec sum_v(0.0f);
  for (int64_t t = 0; t < padded; t += kLanes) {
    const fvec e = (fvec::loadu(s + t) - max_score).exp();
    const fvec kept = fvec::set(fvec(0.0f), e, std::min<int64_t>(kLanes, len - t));
    // bfloat16: P V takes the numerators rounded to bfloat16 (the sum stays unrounded),
    // as torch's flash attention does, so outputs stay Hugging Face's SDPA ones.
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      round_to_bf16(kept).store(s + t);
    } else {
      kept.store(s + t);
    }
    sum_v = sum_v + kept;
  }
  return 1.0f / reduce_add(sum_v);
}

// The most query heads one KV head's pass takes together (more go group by group).
constexpr int64_t kMaxHeads = 64;

// Tokens whose V rows a chunk of the weighted sum holds in L1 for every group of heads.
constexpr int64_t kValueChunk = 16;

// The attention of `heads` query heads on one KV head (`heads` a multiple of kGroup): the
// scores, their softmax, then the probability-weighted sum of V, kGroup heads' accumulators
// in registers at a time. With one group, one pass over the V rows; with more (where fewer
// heads fit the registers than share the KV head: one at the x86-64-v3 level, for SmolLM2's
// three), chunk by chunk, each chunk's rows serving every group from L1, the accumulators
// kept in `acc` between chunks: the same sums in the same order as whole passes per group,
// which read every row once per group, from L2 after the first.
template <int kDim, int kGroup, typename T>
void attend_kv_head(const T* __restrict q, int64_t q_head_stride, const T* __restrict k_cache,
                    const T* __restrict v_cache, const TokenRows& rows, bool prefetch,
                    float scale, T* __restrict out, float* __restrict scores,
                    float* __restrict acc, int64_t heads) {
  constexpr int kVecs = kDim / kLanes;
  const int64_t len = rows.count;
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;

  if constexpr (kBf16DotProducts && std::is_same_v<T, at::BFloat16>) {
    bf16_dot_scores<kDim, kGroup>(q, q_head_stride, k_cache, rows, prefetch, scale, scores,
                                  padded);
  } else {
    float_scores<kDim, kGroup>(q, q_head_stride, k_cache, rows, prefetch, scale, scores, padded,
                               heads);
  }
  float inv_sum[kMaxHeads];
  for (int64_t g = 0; g < heads; ++g) {
    inv_sum[g] = softmax_numerators<T>(scores + g * padded, len, padded);
  }

  if (heads == kGroup) {
    vreg sums[kGroup][kVecs];
    for (int g = 0; g < kGroup; ++g) {
      for (int i = 0; i < kVecs; ++i) sums[g][i] = fvec(0.0f);
    }
    for_each_row<T, kDim>(v_cache, rows, prefetch, kDim, [&](int64_t t, const T* value) {
      vreg v[kVecs];
      for (int i = 0; i < kVecs; ++i) v[i] = load_float(value + kLanes * i);
      for (int g = 0; g < kGroup; ++g) {
        const vreg p = fvec(scores[g * padded + t]);
        for (int i = 0; i < kVecs; ++i) sums[g][i] = fmadd(p, v[i], sums[g][i]);
      }
    });
    for (int g = 0; g < kGroup; ++g) {
      const fvec inv(inv_sum[g]);
      for (int i = 0; i < kVecs; ++i) {
        store_as(fvec(sums[g][i]) * inv, out + g * kDim + kLanes * i);
      }
    }
    return;
  }

  std::fill(acc, acc + heads * kDim, 0.0f);
  RowReader<T, kDim> values(v_cache, rows, prefetch);
  const T* chunk_rows[kValueChunk];
  for (int64_t start = 0; start < len; start += kValueChunk) {
    const int64_t count = std::min<int64_t>(kValueChunk, len - start);
    for (int64_t t = 0; t < count; ++t) chunk_rows[t] = values.next();
    for (int64_t g0 = 0; g0 < heads; g0 += kGroup) {
      vreg sums[kGroup][kVecs];
      for (int g = 0; g < kGroup; ++g) {
        for (int i = 0; i < kVecs; ++i) {
          sums[g][i] = fvec::loadu(acc + (g0 + g) * kDim + kLanes * i);
        }
      }
      for (int64_t t = 0; t < count; ++t) {
        vreg v[kVecs];
        for (int i = 0; i < kVecs; ++i) v[i] = load_float(chunk_rows[t] + kLanes * i);
        for (int g = 0; g < kGroup; ++g) {
          const vreg p = fvec(scores[(g0 + g) * padded + start + t]);
          for (int i = 0; i < kVecs; ++i) sums[g][i] = fmadd(p, v[i], sums[g][i]);
        }
      }
      for (int g = 0; g < kGroup; ++g) {
        for (int i = 0; i < kVecs; ++i) {
          fvec(sums[g][i]).store(acc + (g0 + g) * kDim + kLanes * i);
        }
      }
    }
  }
  for (int64_t g = 0; g < heads; ++g) {
    const fvec inv(inv_sum[g]);
    for (int i = 0; i < kVecs; ++i) {
      store_as(fvec::loadu(acc + g * kDim + kLanes * i) * inv, out + g * kDim + kLanes * i);
    }
  }
}

// Query heads per pass: their V accumulators take at most half the registers (at least 1).
template <int kDim>
constexpr int max_group() { return std::max(1, kVectorRegisters / 2 / (kDim / kLanes)); }

// The query heads sharing one KV head: bfloat16 caches in one attend_kv_head where the heads
// split into groups of kGroup (chunk by chunk over the tokens, the keys widened once for all
// of them), else group by group (a remainder group; AVX512-BF16's scores, which take one
// group a pass; float32), the first pass over K and over V prefetching the rows. At the
// x86-64-v3 level on the Zen 5 (SmolLM2's heads, 64 sequences of 130-320 tokens, 30 layers),
// chunks took bfloat16 from 20.3-20.6 ms to 16.0-16.5; float32 went from 22.9-23.6 to
// 24.3-24.6 (though 0.42 -> 0.30 ms with a layer in cache), so float32 keeps whole passes.
template <typename T, int kDim, int kGroup = max_group<kDim>()>
void attend_heads(const T* q, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                  const TokenRows& rows, float scale, T* out, float* scores, float* acc,
                  int64_t heads, bool prefetch = true) {
  if constexpr (kGroup > 1) {
    if (heads < kGroup) {
      attend_heads<T, kDim, kGroup - 1>(q, q_head_stride, k_cache, v_cache, rows, scale, out,
                                        scores, acc, heads, prefetch);
      return;
    }
  }
  constexpr bool kChunked = std::is_same_v<T, at::BFloat16> && !kBf16DotProducts;
  if (kChunked && heads % kGroup == 0 && heads <= kMaxHeads) {
    attend_kv_head<kDim, kGroup>(q, q_head_stride, k_cache, v_cache, rows, prefetch, scale, out,
                                 scores, acc, heads);
    return;
  }
  for (int64_t g = 0; g < heads; g += kGroup) {
    if (heads - g < kGroup) {
      attend_heads<T, kDim>(q + g * q_head_stride, q_head_stride, k_cache, v_cache, rows, scale,
                            out + g * kDim, scores, acc, heads - g, prefetch && g == 0);
      return;
    }
    attend_kv_head<kDim, kGroup>(q + g * q_head_stride, q_head_stride, k_cache, v_cache, rows,
                                 prefetch && g == 0, scale, out + g * kDim, scores, acc, kGroup);
  }
}

template <typename T>
using AttendFn = void (*)(const T*, int64_t, const T*, const T*, const TokenRows&, float, T*,
                          float*, float*, int64_t, bool);

// The head sizes with a compiled path (each a multiple of every level's lanes), or null.
template <typename T>
AttendFn<T> attend_fn(int64_t head_dim) {
  switch (head_dim) {
    case 64: return &attend_heads<T, 64>;
    case 96: return &attend_heads<T, 96>;
    case 128: return &attend_heads<T, 128>;
    case 256: return &attend_heads<T, 256>;
    default: return nullptr;
  }
}

}  // namespace decode_vec

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
        for (int64_t h = kv_begin; h < kv_begin + kv_per_task; ++h) {
          const T* q_head = q_ptr + s * shape.q_row_stride + h * per_kv * shape.q_head_stride;
          T* out_head = out_ptr + s * shape.out_row_stride + h * per_kv * shape.head_dim;
          attend(q_head, shape.q_head_stride, k_ptr + h * shape.head_dim,
                 v_ptr + h * shape.head_dim, rows, static_cast<float>(scale), out_head,
                 scores.data(), acc.data(), per_kv, true);
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
