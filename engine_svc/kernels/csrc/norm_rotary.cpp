// Fused elementwise ops of a Llama layer, for CPU: RMSNorm (optionally after the residual
// add), rotary embeddings applied in place, and the MLP's silu(gate) * up. Each is one pass
// over its rows where torch runs two to eight kernels, each reading and writing the whole
// activation.
//
// Numerics follow Hugging Face's float32 code: the residual add, the rotary products and sum,
// and RMSNorm's mean of squares are the same IEEE operations in the same order (no FMA
// contraction), so they are bit-identical.

#include "vec.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>


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
// The row functions are flattened: GCC left vector helpers as calls in this unit's later
// functions (its inlining budget spent), which made them slower than scalar code.

// A row's vectors: body(i, n) for the kLanes values from i, n of them in the row (fewer in
// the last vector: loads give zeros past them, stores keep to them).
template <typename Body>
inline void each_vector(int64_t width, Body&& body) {
  for (int64_t i = 0; i < width; i += kLanes) body(i, std::min<int64_t>(kLanes, width - i));
}
inline fvec load(const at::BFloat16* p, int64_t n) {
  return n == kLanes ? fvec(load_bf16(p)) : load_bf16(p, n);
}
inline fvec load(const float* p, int64_t n) { return fvec::loadu(p, n); }
inline void store(fvec rounded, at::BFloat16* p, int64_t n) {
  if (n == kLanes) {
    store_bf16(rounded, p);
  } else {
    store_bf16(rounded, p, n);
  }
}

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

// x * cos + rotate_half(x) * sin, as three rounded operations: no FMA contraction here.
template <typename scalar_t>
__attribute__((optimize("fp-contract=off"))) void rotate_row(scalar_t* __restrict x,
                                                           const float* __restrict cos,
                                                           const float* __restrict sin,
                                                           int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = static_cast<float>(x[i]);
    const float b = static_cast<float>(x[i + half]);
    const scalar_t first_cos = static_cast<scalar_t>(a * static_cast<float>(static_cast<scalar_t>(cos[i])));
    const scalar_t first_sin = static_cast<scalar_t>(-b * static_cast<float>(static_cast<scalar_t>(sin[i])));
    const scalar_t second_cos = static_cast<scalar_t>(b * static_cast<float>(static_cast<scalar_t>(cos[i + half])));
    const scalar_t second_sin = static_cast<scalar_t>(a * static_cast<float>(static_cast<scalar_t>(sin[i + half])));
    x[i] = static_cast<scalar_t>(static_cast<float>(first_cos) + static_cast<float>(first_sin));
    x[i + half] = static_cast<scalar_t>(static_cast<float>(second_cos) + static_cast<float>(second_sin));
  }
}

// bfloat16 in registers (the scalar loop converts one value at a time: 57 us against
// float32's 13 for 64 rows of SmolLM2's 9 query heads on the AMD EPYC Zen 1), with the
// roundings of torch's bfloat16 ops: cos and sin rounded to bfloat16 first (Hugging Face
// casts them to the activations' dtype; the caller rounds them once per token for all the
// heads), each product rounded, then their sum. Every product is rounded before the sum,
// so nothing can contract into an FMA.
__attribute__((flatten)) void rotate_row_bf16(at::BFloat16* __restrict x,
                                              const float* __restrict cos,
                                              const float* __restrict sin, int64_t half) {
  each_vector(half, [&](int64_t i, int64_t n) {
    const fvec a = load(x + i, n), b = load(x + half + i, n);
    const fvec first = round_to_bf16(a * load(cos + i, n)) +
                       round_to_bf16(b.neg() * load(sin + i, n));
    const fvec second = round_to_bf16(b * load(cos + half + i, n)) +
                        round_to_bf16(a * load(sin + half + i, n));
    store(round_to_bf16(first), x + i, n);
    store(round_to_bf16(second), x + half + i, n);
  });
}

__attribute__((flatten)) void round_row_to_bf16(const float* __restrict in,
                                                float* __restrict out, int64_t width) {
  each_vector(width, [&](int64_t i, int64_t n) {
    round_to_bf16(load(in + i, n)).store(out + i, n);
  });
}

// In place on x [tokens, heads, head_dim] (a strided view, head_dim contiguous); cos and sin
// are float32 [tokens, head_dim] in Hugging Face's (freqs, freqs) layout.
void rotary_inplace(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x must be [tokens, heads, head_dim]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rotary: cos and sin must be contiguous float32");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(cos.numel() == tokens * dim && sin.numel() == tokens * dim && dim % 2 == 0,
              "rotary: cos and sin must be [tokens, head_dim]");
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16) {
    at::BFloat16* base = x.data_ptr<at::BFloat16>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      // The token's cos and sin, rounded to bfloat16: the thread's, kept between calls (two
      // calls a layer every step) rather than allocated by each.
      thread_local std::vector<float> rounded;
      if (static_cast<int64_t>(rounded.size()) < 2 * dim) rounded.resize(2 * dim);
      for (int64_t t = begin; t < end; ++t) {
        round_row_to_bf16(c + t * dim, rounded.data(), dim);
        round_row_to_bf16(s + t * dim, rounded.data() + dim, dim);
        for (int64_t h = 0; h < heads; ++h) {
          rotate_row_bf16(base + t * token_stride + h * head_stride, rounded.data(),
                          rounded.data() + dim, dim / 2);
        }
      }
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kHalf, x.scalar_type(), "rotary", [&] {
    scalar_t* base = x.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          rotate_row<scalar_t>(base + t * token_stride + h * head_stride, c + t * dim,
                               s + t * dim, dim / 2);
        }
      }
    });
  });
}

inline void store(fvec v, float* p, int64_t n) { v.store(p, n); }

// One row of silu(gate) * up; in bfloat16, silu(gate) rounded before the product, as
// torch's silu then mul round (a table lookup, vec.h). Two vectors a step: float32's exp is
// a long chain of dependent FMAs, and on a core that splits 256-bit operations in two (the
// Zen 1) one vector a step could not overlap the next one's chain (bfloat16 with exp, 64
// rows of 1536: 215 us against 190 for the 16 values a step before; float32 118).
template <typename T>
__attribute__((flatten)) void silu_and_mul_row(const T* __restrict gate, T* __restrict out,
                                               int64_t width) {
  const T* up = gate + width;
  int64_t i = 0;
  for (; i + 2 * kLanes <= width; i += 2 * kLanes) {
    const fvec first = silu_times<T>(load(gate + i, kLanes), load(up + i, kLanes));
    const fvec second =
        silu_times<T>(load(gate + i + kLanes, kLanes), load(up + i + kLanes, kLanes));
    store(first, out + i, kLanes);
    store(second, out + i + kLanes, kLanes);
  }
  for (; i < width; i += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, width - i);
    store(silu_times<T>(load(gate + i, n), load(up + i, n)), out + i, n);
  }
}

// x: [rows, 2 * width], gate then up (the fused gate_up projection's output) ->
// silu(gate) * up, [rows, width]. silu(g) = g / (1 + exp(-g)) as torch computes it (vec.h)
// in float32; bfloat16 computed in float32 and rounded where torch's two ops round, so both
// are torch's bits wherever torch's loop runs vectors; other dtypes, torch's ops.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1,
              "silu_and_mul: x must be [rows, 2 * width], rows contiguous");
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  auto rows_of = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    auto out = at::empty({rows, width}, x.options());
    const T* in = x.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    const int64_t row_stride = x.stride(0);
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        silu_and_mul_row<T>(in + r * row_stride, dst + r * width, width);
      }
    });
    return out;
  };
  if (x.scalar_type() == at::kFloat) return rows_of(static_cast<float*>(nullptr));
  if (x.scalar_type() == at::kBFloat16) return rows_of(static_cast<at::BFloat16*>(nullptr));
  return at::silu(x.narrow(1, 0, width)).mul_(x.narrow(1, width, width));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_inplace(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_inplace", &rotary_inplace);
  m.impl("silu_and_mul", &silu_and_mul);
}

}  // namespace duoserve
