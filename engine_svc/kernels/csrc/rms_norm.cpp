// RMSNorm for CPU, optionally after the residual add: one pass over each row where torch runs
// several kernels, each reading and writing the whole activation. Numerics follow Hugging
// Face's code: the residual add and the mean of squares are the same IEEE operations in the
// same order (no FMA contraction), so float32 is bit-identical to torch's; bfloat16 rounds
// where torch's ops round.

#include "row_vectors.h"
#include "vec.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace duoserve {
namespace {

// torch's CPU sum kernel, as x.pow(2).mean(-1) runs it in Hugging Face's RMSNorm, adds a
// row's squares in this order; summing them in it makes the mean torch's bit for bit. The
// kernel is registered for AVX2 and not for AVX-512, so on every x86 machine it adds 8-lane
// groups; rows under 8 values take the same scheme over single values. The row's whole
// groups are read as rows of kSumIlp groups, each position with a running sum of its own;
// every 2^power rows of groups a level's sums move into the next level's (and on, while the
// row count is a multiple of the next level's span), so no sum runs over too many terms. The
// levels then add into the first, the groups left over after the last whole row of groups
// add into its first sum, the kSumIlp sums add in turn, and the values past the last whole
// group, summed from 0, take that sum's lanes one by one.
constexpr int kSumLanes = 8;
constexpr int kSumIlp = 4;
constexpr int kSumLevels = 4;

inline int64_t ceil_log2(int64_t x) {
  return x <= 2 ? 1 : std::bit_width(static_cast<uint64_t>(x - 1));
}

// sums[l] += values[l]^2, the square rounded before the add.
template <int Lanes, typename T>
__attribute__((always_inline, optimize("fp-contract=off"))) inline void add_squares(
    float* __restrict sums, const T* __restrict values) {
  for (int l = 0; l < Lanes; ++l) {
    const float v = static_cast<float>(values[l]);
    sums[l] += v * v;
  }
}

template <int Lanes, typename T>
__attribute__((optimize("fp-contract=off"))) float sum_squares_of_groups(const T* __restrict x,
                                                                         int64_t width) {
  const auto add_group = [x](float* sums, int64_t group) {
    add_squares<Lanes>(sums, x + group * Lanes);
  };
  const int64_t groups = width / Lanes, rows = groups / kSumIlp;
  const int64_t power = std::max<int64_t>(4, ceil_log2(rows) / kSumLevels);
  const int64_t step = int64_t{1} << power, mask = step - 1;
  float acc[kSumLevels][kSumIlp][Lanes] = {};
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i) {
      for (int k = 0; k < kSumIlp; ++k) add_group(acc[0][k], i * kSumIlp + k);
    }
    for (int level = 1; level < kSumLevels; ++level) {
      for (int k = 0; k < kSumIlp; ++k) {
        for (int l = 0; l < Lanes; ++l) {
          acc[level][k][l] += acc[level - 1][k][l];
          acc[level - 1][k][l] = 0.0f;
        }
      }
      if ((i & (mask << (level * power))) != 0) break;
    }
  }
  for (; i < rows; ++i) {
    for (int k = 0; k < kSumIlp; ++k) add_group(acc[0][k], i * kSumIlp + k);
  }
  float* first = acc[0][0];
  for (int level = 1; level < kSumLevels; ++level) {
    for (int k = 0; k < kSumIlp; ++k) {
      for (int l = 0; l < Lanes; ++l) acc[0][k][l] += acc[level][k][l];
    }
  }
  for (int64_t g = rows * kSumIlp; g < groups; ++g) add_group(first, g);
  for (int k = 1; k < kSumIlp; ++k) {
    for (int l = 0; l < Lanes; ++l) first[l] += acc[0][k][l];
  }
  float total = 0.0f;
  for (int64_t e = groups * Lanes; e < width; ++e) add_squares<1>(&total, x + e);
  for (int l = 0; l < Lanes; ++l) total += first[l];
  return total;
}

template <typename T>
float torch_sum_of_squares(const T* __restrict x, int64_t width) {
  return width < kSumLanes ? sum_squares_of_groups<1>(x, width)
                           : sum_squares_of_groups<kSumLanes>(x, width);
}

template <typename scalar_t>
void rms_norm_rows(const scalar_t* __restrict x, scalar_t* __restrict residual_out,
                   const scalar_t* __restrict residual_in, const scalar_t* __restrict weight,
                   scalar_t* __restrict out, int64_t rows, int64_t width, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * width;
      scalar_t* yr = out + r * width;
      if (residual_in != nullptr) {  // x + residual, kept as the new residual stream
        const scalar_t* rr = residual_in + r * width;
        scalar_t* sr = residual_out + r * width;
        for (int64_t i = 0; i < width; ++i) {
          sr[i] = static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
        }
        xr = sr;
      }
      const float mean = torch_sum_of_squares(xr, width) / static_cast<float>(width);
      const float inv = 1.0f / std::sqrt(mean + static_cast<float>(eps));
      for (int64_t i = 0; i < width; ++i) {
        const scalar_t normed = static_cast<scalar_t>(static_cast<float>(xr[i]) * inv);
        yr[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * static_cast<float>(normed));
      }
    }
  });
}

// bfloat16 in registers, kLanes values at a time, with the roundings torch's bfloat16 ops
// make: the residual sum, the normalised value and its product by the weight each rounded
// to bfloat16 (round_to_bf16: in the float32 lanes, no packing until the store); the sum of
// squares in torch's order, above. (The scalar loop above converted one value at a time:
// 350 us for 300 rows of 576 on the Intel Xeon, 6% of a bfloat16 batch.)
// The row functions are flattened: when this unit also held rotary and silu * up, GCC left
// vector helpers as calls in its later functions (its inlining budget spent), which made them
// slower than scalar code; rotary.cpp and silu_and_mul.cpp keep the attribute for the same
// reason.

__attribute__((flatten)) void rms_norm_row_bf16(const at::BFloat16* __restrict x,
                                                at::BFloat16* __restrict summed,
                                                const at::BFloat16* __restrict residual,
                                                const at::BFloat16* __restrict weight,
                                                at::BFloat16* __restrict out, int64_t width,
                                                float eps) {
  const at::BFloat16* row = x;  // what is normalised: x, or x + residual
  if (residual != nullptr) {  // x + residual, rounded: the new residual stream
    each_vector(width, [&](int64_t i, int64_t n) {
      store(round_to_bf16(load(x + i, n) + load(residual + i, n)), summed + i, n);
    });
    row = summed;
  }
  const float mean = torch_sum_of_squares(row, width) / static_cast<float>(width);
  const fvec inv(1.0f / std::sqrt(mean + eps));
  each_vector(width, [&](int64_t i, int64_t n) {
    // The normalised value, rounded, then its product by the weight.
    const fvec normed = round_to_bf16(load(row + i, n) * inv);
    store(round_to_bf16(load(weight + i, n) * normed), out + i, n);
  });
}

template <>
void rms_norm_rows<at::BFloat16>(const at::BFloat16* __restrict x,
                                 at::BFloat16* __restrict residual_out,
                                 const at::BFloat16* __restrict residual_in,
                                 const at::BFloat16* __restrict weight,
                                 at::BFloat16* __restrict out, int64_t rows, int64_t width,
                                 double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bool add = residual_in != nullptr;  // else both residual pointers are null
      rms_norm_row_bf16(x + r * width, add ? residual_out + r * width : nullptr,
                        add ? residual_in + r * width : nullptr, weight, out + r * width, width,
                        static_cast<float>(eps));
    }
  });
}

// rms_norm(x) -> weight * (x * rsqrt(mean(x^2) + eps)), rows of x contiguous.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm needs contiguous tensors");
  TORCH_CHECK(x.size(-1) == weight.numel() && x.scalar_type() == weight.scalar_type(),
              "rms_norm: weight must match x's last dimension and dtype");
  auto out = at::empty_like(x);
  const int64_t width = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, nullptr, weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.numel() / width, width, eps);
  });
  return out;
}

// add_rms_norm(x, residual) -> (x + residual, rms_norm(x + residual)): the residual stream
// and the next sublayer's input in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "add_rms_norm needs contiguous tensors");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm: x and residual differ");
  TORCH_CHECK(x.size(-1) == weight.numel() && x.scalar_type() == weight.scalar_type(),
              "add_rms_norm: weight must match x's last dimension and dtype");
  auto summed = at::empty_like(x);
  auto out = at::empty_like(x);
  const int64_t width = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), summed.data_ptr<scalar_t>(),
                            residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.numel() / width, width, eps);
  });
  return {summed, out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}

}  // namespace duoserve
