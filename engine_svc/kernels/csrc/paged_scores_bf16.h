// Decode attention's scores from a bfloat16 cache on AVX512-BF16 (paged_attention_vec.h takes
// them where the build has it): the keys multiplied as they lie, in pairs, with no widening.
#pragma once

#include "paged_rows.h"
#include "vec.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

namespace duoserve {
namespace decode_vec {

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

}  // namespace decode_vec
}  // namespace duoserve
