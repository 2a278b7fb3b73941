// One row times a bfloat16 weight in nn.Linear's layout, [out, in]: a lone request's decode
// step, where torch's bfloat16 matmul is oneDNN's (x86 with AVX-512 or AMX).
//
// There the projections keep Hugging Face's [out, in] weights for torch's F.linear, which
// serves every row count from two rows up. At one row oneDNN reads them slowly: SmolLM2-135M's
// 30 layers and LM head (269 MB of bfloat16) took 22-33 ms on the 2-core AMD EPYC Zen 4,
// where a plain read of as many bytes takes 9. Each output here is the dot product of the row
// with one weight row, and the rows run one after the other, so a thread's share of outputs
// is one stretch of memory read front to back: 16-17 ms there (the packed kernel's panels,
// which torch cannot read for more rows, 12-15). Interleaving four weight rows instead ran
// at half that speed, and software prefetches slowed it: short streams the prefetchers lose.
// The products and sums run in float32 (products of two bfloat16 values are exact) and the
// result is rounded to bfloat16 once, as torch's bfloat16 matmul does; the sums run in
// another order than oneDNN's, so results differ from torch's by float rounding.

#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace duoserve {
namespace {

// Independent sums per row over alternate vectors of k, to hide the FMA latency; the rows
// run one after the other, so a thread reads its weights as one stream, front to back.
constexpr int kChains = 4;

// out[r] = x . w[r] for kLanes rows (the vector part of k), as one vector of sums.
inline fvec dot_rows(const float* __restrict x, const at::BFloat16* __restrict w, int64_t k,
                     int64_t k_vec) {
  vreg sums[kLanes];
  for (int r = 0; r < kLanes; ++r) {
    const at::BFloat16* row = w + r * k;
    vreg acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = fvec(0.0f);
    int64_t kk = 0;
    for (; kk + kChains * kLanes <= k_vec; kk += kChains * kLanes) {
      for (int i = 0; i < kChains; ++i) {
        acc[i] = fmadd(fvec::loadu(x + kk + i * kLanes), load_bf16(row + kk + i * kLanes), acc[i]);
      }
    }
    for (int i = 0; kk < k_vec; kk += kLanes, ++i) {
      acc[i] = fmadd(fvec::loadu(x + kk), load_bf16(row + kk), acc[i]);
    }
    for (int i = 1; i < kChains; ++i) acc[0] = fvec(acc[0]) + fvec(acc[i]);
    sums[r] = acc[0];
  }
  return transpose_sum(sums);
}

// The part of k past the last whole vector, added to each row's vector sum.
inline float dot_tail(const float* x, const at::BFloat16* w, int64_t k, int64_t k_vec) {
  float sum = 0.0f;
  for (int64_t kk = k_vec; kk < k; ++kk) sum = std::fma(x[kk], static_cast<float>(w[kk]), sum);
  return sum;
}

// out[n0, n1) = x . weight[n]^T (+ bias), rounded to bfloat16.
void gemv_range(const float* x, const at::BFloat16* weight, int64_t k, const float* bias,
                at::BFloat16* out, int64_t n0, int64_t n1) {
  const int64_t k_vec = k - k % kLanes;
  __at_align__ float sums[kLanes];
  int64_t n = n0;
  for (; n + kLanes <= n1; n += kLanes) {
    const at::BFloat16* rows = weight + n * k;
    fvec sum = dot_rows(x, rows, k, k_vec);
    if (k_vec < k) {
      for (int r = 0; r < kLanes; ++r) sums[r] = dot_tail(x, rows + r * k, k, k_vec);
      sum = sum + fvec::loadu(sums);
    }
    if (bias != nullptr) sum = sum + fvec::loadu(bias + n);
    sum.store(sums);
    at::vec::convert(sums, out + n, kLanes);
  }
  for (; n < n1; ++n) {  // the last rows, fewer than a vector's worth
    const at::BFloat16* row = weight + n * k;
    fvec acc(0.0f);
    for (int64_t kk = 0; kk < k_vec; kk += kLanes) {
      acc = fvec(fmadd(fvec::loadu(x + kk), load_bf16(row + kk), acc));
    }
    float sum = reduce_add(acc) + dot_tail(x, row, k, k_vec);
    if (bias != nullptr) sum += bias[n];
    out[n] = static_cast<at::BFloat16>(sum);
  }
}

at::Tensor row_gemv(const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.is_contiguous(),
              "weight must be a contiguous bfloat16 [out_features, in_features]");
  const int64_t n = weight.size(0);
  const int64_t k = weight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.size(1) == k &&
                  x.scalar_type() == at::kBFloat16,
              "x must be bfloat16 [1, in_features]");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n && bias->scalar_type() == at::kBFloat16,
                "bias must be bfloat16 [out_features]");
  }
  // The row and the bias widened once, into plain buffers: an ATen conversion per call cost
  // more than a small projection's product.
  const at::Tensor x_row = x.contiguous();
  std::vector<float> x32(k);
  widen_bf16(x_row.data_ptr<at::BFloat16>(), x32.data(), k);
  std::vector<float> bias32;
  if (bias.has_value()) {
    bias32.resize(n);
    widen_bf16(bias->contiguous().data_ptr<at::BFloat16>(), bias32.data(), n);
  }
  auto out = at::empty({1, n}, x.options());
  const float* x_ptr = x32.data();
  const at::BFloat16* w_ptr = weight.data_ptr<at::BFloat16>();
  const float* bias_ptr = bias.has_value() ? bias32.data() : nullptr;
  at::BFloat16* out_ptr = out.data_ptr<at::BFloat16>();
  // Threads take whole vectors of rows (a thread's rows are one stretch of the weight).
  const int64_t groups = (n + kLanes - 1) / kLanes;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    gemv_range(x_ptr, w_ptr, k, bias_ptr, out_ptr, begin * kLanes, std::min(n, end * kLanes));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def("row_gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) { m.impl("row_gemv", &row_gemv); }

}  // namespace duoserve
