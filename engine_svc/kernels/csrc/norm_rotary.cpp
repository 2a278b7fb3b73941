// Fused elementwise ops of a Llama layer, for CPU: RMSNorm (optionally after the residual
// add), rotary embeddings applied in place, and the MLP's silu(gate) * up. Each is one pass
// over its rows where torch runs two to eight kernels, each reading and writing the whole
// activation.
//
// Numerics follow Hugging Face's float32 code: the residual add and the rotary products and
// sum are the same IEEE operations in the same order (no FMA contraction), so they are
// bit-identical; RMSNorm's mean of squares is summed in another order than torch's, which can
// move the result by an ulp.

#include "vec.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>


namespace duoserve {
namespace {

template <typename scalar_t>
void rms_norm_rows(const scalar_t* __restrict x, scalar_t* __restrict residual_out,
                   const scalar_t* __restrict residual_in, const scalar_t* __restrict weight,
                   scalar_t* __restrict out, int64_t rows, int64_t width, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * width;
      scalar_t* yr = out + r * width;
      float sum = 0.0f;
      if (residual_in != nullptr) {  // x + residual, kept as the new residual stream
        const scalar_t* rr = residual_in + r * width;
        scalar_t* sr = residual_out + r * width;
        for (int64_t i = 0; i < width; ++i) {
          const scalar_t v = static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          sr[i] = v;
          sum += static_cast<float>(v) * static_cast<float>(v);
        }
        xr = sr;
      } else {
        for (int64_t i = 0; i < width; ++i) sum += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      }
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(width) + static_cast<float>(eps));
      for (int64_t i = 0; i < width; ++i) {
        const scalar_t normed = static_cast<scalar_t>(static_cast<float>(xr[i]) * inv);
        yr[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * static_cast<float>(normed));
      }
    }
  });
}

// bfloat16 in registers, 2 * kLanes values at a time (the scalar loop above converts one
// value at a time: 350 us for 300 rows of 576 on the Intel Xeon, 6% of a bfloat16 batch;
// a version that widened whole rows into float32 buffers between passes still took 31 us
// for 64 rows). The same roundings: the residual sum, the normalised value and its product
// by the weight each rounded to bfloat16, as torch's ops round; only the sum of squares
// runs in another order than torch's.
using bvec = at::vec::Vectorized<at::BFloat16>;
constexpr int64_t kBf16Lanes = bvec::size();

// Both halves of `count` bfloat16 values as float32 (zeros past count), and the reverse,
// rounded to nearest even as at::vec::convert rounds.
inline std::tuple<fvec, fvec> widen(const at::BFloat16* p, int64_t count) {
  return at::vec::convert_bfloat16_float(bvec::loadu(p, count));
}
inline bvec rounded(fvec low, fvec high) { return at::vec::convert_float_bfloat16(low, high); }

template <typename Body>
void each_bf16_vector(int64_t width, Body&& body) {
  for (int64_t i = 0; i < width; i += kBf16Lanes) body(i, std::min(kBf16Lanes, width - i));
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
      const at::BFloat16* row = x + r * width;
      fvec squares(0.0f);  // lanes past the row's end add zeros
      if (residual_in != nullptr) {  // x + residual, rounded: the new residual stream
        at::BFloat16* summed = residual_out + r * width;
        each_bf16_vector(width, [&](int64_t i, int64_t n) {
          const auto [x0, x1] = widen(row + i, n);
          const auto [r0, r1] = widen(residual_in + r * width + i, n);
          const bvec sum = rounded(x0 + r0, x1 + r1);
          sum.store(summed + i, n);
          const auto [s0, s1] = at::vec::convert_bfloat16_float(sum);
          squares = at::vec::fmadd(s1, s1, at::vec::fmadd(s0, s0, squares));
        });
        row = summed;
      } else {
        each_bf16_vector(width, [&](int64_t i, int64_t n) {
          const auto [v0, v1] = widen(row + i, n);
          squares = at::vec::fmadd(v1, v1, at::vec::fmadd(v0, v0, squares));
        });
      }
      const fvec inv(1.0f / std::sqrt(reduce_add(squares) / static_cast<float>(width) +
                                      static_cast<float>(eps)));
      at::BFloat16* y = out + r * width;
      each_bf16_vector(width, [&](int64_t i, int64_t n) {
        const auto [v0, v1] = widen(row + i, n);
        // The normalised value, rounded, then its product by the weight.
        const auto [n0, n1] = at::vec::convert_bfloat16_float(rounded(v0 * inv, v1 * inv));
        const auto [w0, w1] = widen(weight + i, n);
        rounded(w0 * n0, w1 * n1).store(y + i, n);
      });
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    scalar_t* base = x.data_ptr<scalar_t>();
    const float* c = cos.data_ptr<float>();
    const float* s = sin.data_ptr<float>();
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

// silu(g) = g / (1 + exp(-g)), with vec.h's exp.
inline fvec silu(fvec g) { return g / (fvec(1.0f) + exp(fvec(0.0f) - g)); }

// x: [rows, 2 * width], gate then up (the fused gate_up projection's output) ->
// silu(gate) * up, [rows, width]. silu(g) = g / (1 + exp(-g)) with a vectorized exp (within
// 2 ulp of expf, so within a few ulp of torch's silu) in float32; bfloat16 computed in float32
// and rounded where torch's two ops round; other dtypes, torch's ops.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1,
              "silu_and_mul: x must be [rows, 2 * width], rows contiguous");
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  if (x.scalar_type() == at::kFloat) {
    auto out = at::empty({rows, width}, x.options());
    const float* in = x.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    const int64_t row_stride = x.stride(0);
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* gate = in + r * row_stride;
        const float* up = gate + width;
        float* o = dst + r * width;
        for (int64_t i = 0; i < width; i += kLanes) {
          const int64_t count = std::min<int64_t>(kLanes, width - i);
          (silu(fvec::loadu(gate + i, count)) * fvec::loadu(up + i, count)).store(o + i, count);
        }
      }
    });
    return out;
  }
  if (x.scalar_type() == at::kBFloat16) {
    auto out = at::empty({rows, width}, x.options());
    const at::BFloat16* in = x.data_ptr<at::BFloat16>();
    at::BFloat16* dst = out.data_ptr<at::BFloat16>();
    const int64_t row_stride = x.stride(0);
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const at::BFloat16* gate = in + r * row_stride;
        const at::BFloat16* up = gate + width;
        each_bf16_vector(width, [&](int64_t i, int64_t n) {
          const auto [g0, g1] = widen(gate + i, n);
          const auto [u0, u1] = widen(up + i, n);
          // silu(gate) rounded to bfloat16 before the product, as torch's silu then mul round.
          const auto [s0, s1] = at::vec::convert_bfloat16_float(rounded(silu(g0), silu(g1)));
          rounded(s0 * u0, s1 * u1).store(dst + r * width + i, n);
        });
      }
    });
    return out;
  }
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
