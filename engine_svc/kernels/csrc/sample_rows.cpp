// Random sampling's draw for rows without top-k and without a seed: sample_rows follows
// engine_svc/worker/random_sampling.py's torch path (temperature, top-p, min-p and one draw by
// the inverse of the row's cumulative weights) over the row's numerators (sampling_rows.h).
//
// A row's numerators e (the most likely's is exp(0) = 1, its probability e / sum):
// - without top-p, min-p zeroes the e under min_p (min_p times the most likely's), and the
//   draw picks the first token whose cumulative weight exceeds u times the total;
// - with top-p, by rejection as the torch path: draw among the e above a pivot (at first 0);
//   keep the token if the e above it sum under top_p times the whole sum and it passes
//   min-p; else raise the pivot to it and draw again with the part of u that fell in its
//   interval; after max_rounds misses, sort the tokens above the pivot and take top-p's
//   prefix of them.
// Cumulative weights are summed in double a vector at a time, the same way for the total and
// the walk, so a target under the total is always crossed.

#include "sampling_rows.h"
#include "vec.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace duoserve {
namespace {

using namespace sampling;  // what both draws share

struct Draw {
  int64_t index;
  double before;  // the cumulative weight before it
};

// The first index whose cumulative weight (above `pivot`) exceeds target; target is under
// total_above's total, but where rounding left it at or over, the last weight above the pivot.
Draw walk(const float* e, int64_t padded, float pivot, double target) {
  const fvec p(pivot);
  double cumulative = 0.0;
  for (int64_t i = 0; i < padded; i += kLanes) {
    const double block = reduce_add(weights_at(e, i, p));
    if (cumulative + block > target) {
      // Some weight in the block is above the pivot (block > target - cumulative >= 0).
      Draw last{i, cumulative};
      double inside = cumulative;
      for (int64_t j = i; j < i + kLanes; ++j) {
        if (e[j] <= pivot) continue;
        if (inside + e[j] > target) return {j, inside};
        last = {j, inside};
        inside += e[j];
      }
      return last;  // the lanes summed a shade over the scalars
    }
    cumulative += block;
  }
  int64_t j = padded - 1;
  while (j > 0 && e[j] <= pivot) --j;
  return {j, cumulative - e[j]};
}

// The last resort of a top-p row: the tokens above the pivot in order, top-p's prefix and
// min-p's kept, one drawn with u.
int64_t draw_sorted(const float* e, int64_t n, float pivot, double sum, const RowParams& row,
                    double u) {
  std::vector<int64_t> above;
  for (int64_t i = 0; i < n; ++i) {
    if (e[i] > pivot) above.push_back(i);
  }
  if (above.empty()) return std::max_element(e, e + n) - e;  // top_p 0: nothing is kept
  std::stable_sort(above.begin(), above.end(), [&](int64_t a, int64_t b) { return e[a] > e[b]; });
  double mass = 0.0, kept_total = 0.0;
  std::vector<double> kept;
  for (int64_t i : above) {
    if (mass >= row.top_p * sum) break;
    mass += e[i];
    kept.push_back(e[i] >= row.min_p ? e[i] : 0.0);
    kept_total += kept.back();
  }
  double cumulative = 0.0;
  const double target = u * kept_total;
  int64_t chosen = above.front();
  for (size_t k = 0; k < kept.size(); ++k) {
    if (kept[k] <= 0.0) continue;
    chosen = above[k];
    cumulative += kept[k];
    if (cumulative > target) break;
  }
  return chosen;
}

template <typename T>
int64_t sample_row(const T* logits, int64_t n, const RowParams& row, int64_t max_rounds,
                   std::vector<float>& buffer) {
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  buffer.resize(padded);
  float* e = buffer.data();
  const bool nucleus = row.top_p < 1.0f;
  // The most likely token's numerator is 1: min-p's floor is min_p itself. With top-p, min-p
  // applies after it, so it is checked on the drawn token instead.
  fill_numerators(logits, n, row_max(logits, n), row.inv_temperature, nucleus ? 0.0f : row.min_p,
                  e);
  const double sum = total_above(e, padded, 0.0f);
  if (!drawable(sum)) return degenerate_row(logits, n);
  double u = row.u;
  if (!nucleus) return walk(e, padded, 0.0f, u * sum).index;
  float pivot = 0.0f;
  double weight = sum;  // of the e above the pivot
  for (int64_t round = 0; round < max_rounds; ++round) {
    const double target = u * weight;
    const Draw draw = walk(e, padded, pivot, target);
    const float chosen = e[draw.index];
    const bool in_nucleus = weight - chosen < row.top_p * sum ||
                            total_above(e, padded, chosen) < row.top_p * sum;  // the e above it
    if (in_nucleus && chosen >= row.min_p) return draw.index;
    u = std::clamp((target - draw.before) / chosen, 0.0, 1.0 - 0x1p-53);
    pivot = chosen;
    weight = total_above(e, padded, pivot);
  }
  return draw_sorted(e, n, pivot, sum, row, u);
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                       const at::Tensor& top_p, const at::Tensor& min_p,
                       const at::Tensor& uniforms, int64_t max_rounds) {
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() &&
                  uniforms.numel() == logits.size(0),
              "sample_rows: uniforms must be float64 [rows]");
  const double* u = uniforms.const_data_ptr<double>();
  return draw_rows("sample_rows", logits, temperature, top_p, min_p, max_rounds,
                   [&](const auto* row_logits, int64_t n, RowParams row, int64_t r,
                       std::vector<float>& buffer) {
                     row.u = u[r];
                     return sample_row(row_logits, n, row, max_rounds, buffer);
                   });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def(
      "sample_rows(Tensor logits, Tensor temperature, Tensor top_p, Tensor min_p, "
      "Tensor uniforms, int max_rounds) -> Tensor");
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) { m.impl("sample_rows", &sample_rows); }

}  // namespace duoserve
