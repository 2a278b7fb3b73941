// Rotary embeddings applied in place on CPU: x * cos + rotate_half(x) * sin in one pass over
// q or k, where torch runs several kernels. Numerics follow Hugging Face's code: the products
// and their sum are the same IEEE operations in the same order (no FMA contraction), so
// float32 is bit-identical to torch's; bfloat16 rounds where torch's ops round.

#include "row_vectors.h"
#include "vec.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace duoserve {
namespace {

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def("rotary_inplace(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) { m.impl("rotary_inplace", &rotary_inplace); }

}  // namespace duoserve
