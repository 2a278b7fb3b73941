// What random sampling's two draws share (sample_rows.cpp: a draw by the inverse of the
// row's cumulative weights; race_rows.cpp: seeded rows' exponential race), neither writing
// the [rows, vocab] intermediates of the torch path: a row's numerators exp((l - max) / T),
// their sums above a pivot, the rows handed out over the threads.
//
// In torch a row took the quotient by the temperature (a float32 copy), the softmax, its
// cumulative sum and, for top-p, a masked sum: passes over 64 x 49,152 floats through
// memory. In a bfloat16 batch on the 2-core Xeon with AMX (`python -m engine_svc.bench steps
// --dtype bfloat16 --temperature 1.0`, then with --top-p 0.95 at temperature 0.8), sampling
// took 7.6 and 12.1 ms a decode step; here 3.0 and 3.0-3.2. A thread reads each of its rows once
// for the maximum and once for the numerators exp((l - max) / T), which it keeps in a buffer
// of the row's size (L2), and draws from that buffer.
#pragma once

#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace duoserve {
namespace sampling {

// e[i] = exp((row[i] - max) / T), or 0 under `floor`; n a multiple of kLanes in e (the tail
// padded with zeros).
template <typename T>
void fill_numerators(const T* row, int64_t n, float max, float inv_t, float floor, float* e) {
  const fvec shift(max), scale(inv_t), low(floor), zero(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const fvec v = ((load_lanes(row + i) - shift) * scale).exp();
    fvec::blendv(zero, v, v >= low).store(e + i);
  }
  for (; i < n; ++i) {
    const float v = std::exp((static_cast<float>(row[i]) - max) * inv_t);
    e[i] = v >= floor ? v : 0.0f;
  }
  for (; i % kLanes != 0; ++i) e[i] = 0.0f;
}

// The weights above `pivot` (0 at and below it), a vector at a time from e.
inline fvec weights_at(const float* e, int64_t i, const fvec& pivot) {
  const fvec v = fvec::loadu(e + i);
  return fvec::blendv(fvec(0.0f), v, v > pivot);
}

inline double total_above(const float* e, int64_t padded, float pivot) {
  const fvec p(pivot);
  double total = 0.0;
  for (int64_t i = 0; i < padded; i += kLanes) total += reduce_add(weights_at(e, i, p));
  return total;
}

// A row whose numerators do not sum to a positive finite number (a logit of +inf or NaN,
// every logit -inf) draws nothing: its first largest logit stands in, NaN aside (0 if every
// logit is NaN or -inf).
template <typename T>
int64_t degenerate_row(const T* row, int64_t n) {
  int64_t best = 0;
  float most = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (v > most) {  // NaN never is
      most = v;
      best = i;
    }
  }
  return best;
}

inline bool drawable(double sum) { return sum > 0.0 && std::isfinite(sum); }

struct RowParams {
  float inv_temperature, top_p, min_p;
  double u;
};

template <typename T, typename Draw>
void draw_rows_of(const at::Tensor& logits, const float* temperature, const float* top_p,
                  const float* min_p, int64_t* out, const Draw& draw) {
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  const T* base = logits.const_data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buffer;
    for (int64_t r = begin; r < end; ++r) {
      const RowParams row{1.0f / temperature[r], top_p[r], min_p[r], 0.0};
      out[r] = draw(base + r * stride, n, row, r, buffer);
    }
  });
}

// Each row's token, `draw(row's logits, vocab size, its params, row index, a buffer)`, the
// rows over the threads, after the checks both operators share.
template <typename Draw>
at::Tensor draw_rows(const char* op, const at::Tensor& logits, const at::Tensor& temperature,
                     const at::Tensor& top_p, const at::Tensor& min_p, int64_t max_rounds,
                     const Draw& draw) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1, op,
              ": logits must be [rows, vocab], rows contiguous");
  for (const at::Tensor* t : {&temperature, &top_p, &min_p}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == logits.size(0),
                op, ": temperature, top_p and min_p must be float32 [rows]");
  }
  TORCH_CHECK(max_rounds >= 0, op, ": max_rounds must be 0 or more");
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  const float* t = temperature.const_data_ptr<float>();
  const float* p = top_p.const_data_ptr<float>();
  const float* m = min_p.const_data_ptr<float>();
  int64_t* dst = out.mutable_data_ptr<int64_t>();
  if (logits.scalar_type() == at::kFloat) {
    draw_rows_of<float>(logits, t, p, m, dst, draw);
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16, op,
                ": logits must be float32 or bfloat16");
    draw_rows_of<at::BFloat16>(logits, t, p, m, dst, draw);
  }
  return out;
}

}  // namespace sampling
}  // namespace duoserve
