// Decode attention's vector path (paged_attention.cpp) on Vectorized<float> (vec.h), for
// float32 and bfloat16 caches (bfloat16 rows widened to float32 as they are loaded; the math in
// float32 either way) and the head sizes below (compile-time widths, so the accumulators can
// live in registers). Per KV head, `kGroup` query heads at a time:
// - scores kLanes tokens at a time: each token's dot product folds into one vector, and one
//   transpose-and-add tree turns the kLanes vectors into the kLanes scores (in place of kLanes
//   horizontal sums); bfloat16 keys on AVX512-BF16 by its dot products (paged_scores_bf16.h);
// - softmax with the vectorized exp of vec.h;
// - the weighted sum of V with the query heads' accumulators in registers.
#pragma once

#include "paged_rows.h"
#include "paged_scores_bf16.h"
#include "vec.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace duoserve {
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

}  // namespace duoserve
