// bfloat16 projections for decode's row counts on AVX512-BF16 (vdpbf16ps), over weights
// packed once in pairs of k.
//
// oneDNN's prepacked bfloat16 GEMM runs near the FMA units' peak when its weights are in
// cache, but in a decode step every projection's weights stream from memory, and its kernel
// does not fetch ahead: SmolLM2-135M's 120 decoder projections at 64 rows took 19 ms with
// the weights streaming against 14.5 with them in cache (the Zen 5), about the time the
// 212 MB take to arrive. Here, as the float32 register tile does (gemm_tile.h), each panel
// of columns is computed while the thread's next panel is requested into L2, spread over the
// loop.
//
// Layout: [ceil(N / block), K / 2, block, 2]: each panel is K / 2 steps of `block` columns
// times two consecutive k, so one 64-byte vector holds 16 columns' pairs, what vdpbf16ps
// multiplies by a broadcast pair of the row's k. The sums run in float32 in k order, a pair
// at a time, each output in one accumulator; the bias is added to the sum and the result
// rounded to bfloat16 once, at the end.

#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

namespace duoserve {
namespace {

// Columns per panel: two vectors of 16.
constexpr int64_t kPairsBlock = 32;

at::Tensor pack_bf16_pairs(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be bfloat16 [out_features, in_features]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % 2 == 0, "in_features must be even, got ", k);
  const int64_t blocks = (n + kPairsBlock - 1) / kPairsBlock;
  auto padded = at::zeros({blocks * kPairsBlock, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [blocks, block, K / 2, 2] -> [blocks, K / 2, block, 2]
  return padded.view({blocks, kPairsBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)

constexpr int kVecs = kPairsBlock / 16;
constexpr int kMaxRows = 12;  // 24 accumulators, 2 panel vectors and the broadcast pair

template <int kRows>
void pairs_tile(const at::BFloat16* __restrict a, int64_t lda, const at::BFloat16* __restrict panel,
                int64_t pairs, const float* __restrict bias, at::BFloat16* __restrict c,
                int64_t ldc, int64_t cols, const char* next, int64_t prefetch) {
  __m512 acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  const int64_t per_step = (prefetch + pairs - 1) / pairs;
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t line = p * per_step; line < std::min(prefetch, (p + 1) * per_step); ++line) {
      prefetch_l2(next + 64 * line);
    }
    __m512bh b[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      b[v] = (__m512bh)_mm512_loadu_si512(panel + (p * kVecs + v) * 32);
    }
    for (int r = 0; r < kRows; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof(pair));
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, b[v]);
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    const int64_t lanes = std::clamp<int64_t>(cols - 16 * v, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
    const __m512 add = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + 16 * v)
                                       : _mm512_setzero_ps();
    for (int r = 0; r < kRows; ++r) {
      const __m512 sum = bias != nullptr ? _mm512_add_ps(acc[r][v], add) : acc[r][v];
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(sum);
      _mm256_mask_storeu_epi16(c + r * ldc + 16 * v, mask, rounded);
    }
  }
}

template <int kRows = kMaxRows>
void pairs_tile_rows(int64_t rows, const at::BFloat16* a, int64_t lda,
                     const at::BFloat16* panel, int64_t pairs, const float* bias,
                     at::BFloat16* c, int64_t ldc, int64_t cols, const char* next,
                     int64_t prefetch) {
  if constexpr (kRows > 1) {
    if (rows < kRows) {
      pairs_tile_rows<kRows - 1>(rows, a, lda, panel, pairs, bias, c, ldc, cols, next,
                                 prefetch);
      return;
    }
  }
  pairs_tile<kRows>(a, lda, panel, pairs, bias, c, ldc, cols, next, prefetch);
}

void pairs_gemm(const at::BFloat16* a, int64_t lda, int64_t m, const at::BFloat16* packed,
                int64_t blocks, int64_t pairs, const float* bias, at::BFloat16* c,
                int64_t n) {
  const int64_t panel_size = pairs * kPairsBlock * 2;
  const int64_t lines = panel_size * 2 / 64;
  const int64_t tiles = (m + kMaxRows - 1) / kMaxRows;
  const int64_t share = (lines + tiles - 1) / tiles;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const at::BFloat16* panel = packed + b * panel_size;
      const char* next = b + 1 < end ? reinterpret_cast<const char*>(panel + panel_size) : nullptr;
      const int64_t cols = std::min(kPairsBlock, n - b * kPairsBlock);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = t * kMaxRows;
        const int64_t prefetch =
            next == nullptr ? 0 : std::clamp<int64_t>(lines - t * share, 0, share);
        pairs_tile_rows(std::min<int64_t>(kMaxRows, m - m0), a + m0 * lda, lda, panel, pairs,
                        bias != nullptr ? bias + b * kPairsBlock : nullptr,
                        c + m0 * n + b * kPairsBlock, n, cols,
                        next == nullptr ? nullptr : next + 64 * t * share, prefetch);
      }
    }
  });
}

#endif

at::Tensor bf16_pairs_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                             const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == kPairsBlock && packed.size(3) == 2,
              "packed must be pack_bf16_pairs' [blocks, in_features / 2, 32, 2]");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bfloat16 [rows, in]");
  const int64_t pairs = packed.size(1), n = out_features;
  TORCH_CHECK(x.size(1) == 2 * pairs, "x has ", x.size(1), " features, the weight takes ",
              2 * pairs);
  TORCH_CHECK(n >= 1 && n <= packed.size(0) * kPairsBlock &&
                  n > (packed.size(0) - 1) * kPairsBlock,
              "out_features does not match the packed weight");
  std::optional<at::Tensor> bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n && bias->scalar_type() == at::kBFloat16,
                "bias must be bfloat16 [out_features]");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor a = x.stride(1) == 1 ? x : x.contiguous();
  auto out = at::empty({x.size(0), n}, x.options());
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if (x.size(0) > 0) {
    pairs_gemm(a.const_data_ptr<at::BFloat16>(), a.stride(0), a.size(0),
               packed.const_data_ptr<at::BFloat16>(), packed.size(0), pairs,
               bias32.has_value() ? bias32->const_data_ptr<float>() : nullptr,
               out.mutable_data_ptr<at::BFloat16>(), n);
  }
  return out;
#else
  TORCH_CHECK(false, "bf16_pairs_linear: this build has no AVX512-BF16 dot products");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def("pack_bf16_pairs(Tensor weight) -> Tensor");
  m.def("bf16_pairs_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) {
  m.impl("pack_bf16_pairs", &pack_bf16_pairs);
  m.impl("bf16_pairs_linear", &bf16_pairs_linear);
}

}  // namespace duoserve
