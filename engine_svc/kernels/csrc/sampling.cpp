// Random sampling's draws for rows without top-k, without writing the [rows, vocab]
// intermediates: sample_rows follows engine_svc/worker/random_sampling.py's torch path
// (temperature, top-p, min-p and one draw by the inverse of the row's cumulative weights);
// race_rows, for seeded rows, seeded_sampling.py's exponential race (below).
//
// In torch a row took the quotient by the temperature (a float32 copy), the softmax, its
// cumulative sum and, for top-p, a masked sum: passes over 64 x 49,152 floats through
// memory. In a bfloat16 batch on the 2-core Xeon with AMX (`python -m engine_svc.bench steps
// --dtype bfloat16 --temperature 1.0`, then with --top-p 0.95 at temperature 0.8), sampling
// took 7.6 and 12.1 ms a decode step; here 3.0 and 3.0-3.2. A thread reads each of its rows once
// for the maximum and once for the numerators exp((l - max) / T), which it keeps in a buffer
// of the row's size (L2), and draws from that buffer.
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

#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace duoserve {
namespace {

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

double total_above(const float* e, int64_t padded, float pivot) {
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

struct RowParams {
  float inv_temperature, top_p, min_p;
  double u;
};

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

// Seeded rows: the exponential race of engine_svc/worker/seeded_sampling.py, each token's
// Exp(1) number E hashed from the row's key and the token id there and here alike (the
// integer steps bit for bit; -log1p(-w) through the vectorized log1p torch's CPU log1p runs):
// the winner is the largest e / E among the kept tokens. Filling a row's 49,152 numbers from
// a seeded torch.Generator took 0.88 ms; here the hash, the logarithm and the ratios are one
// pass over the row in L2.
inline uint32_t mix32(uint32_t x) {  // lowbias32
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// The largest w (the float32 below 1): E = -log1p(-w) stays finite.
constexpr float kMaxW = 1.0f - 0x1p-24f;

// r[i] = e[i] / E(key, i) over the padded row (0 where e is 0).
void fill_ratios(const float* e, int64_t padded, uint64_t key, float* r) {
  const uint32_t low = static_cast<uint32_t>(key), high = static_cast<uint32_t>(key >> 32);
  __at_align__ float u[kLanes];
  for (int64_t i = 0; i < padded; i += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) {
      const uint32_t h = mix32(mix32(static_cast<uint32_t>(i + j) ^ low) ^ high);
      u[j] = -std::min((static_cast<float>(h) + 0.5f) * 0x1p-32f, kMaxW);  // -w
    }
    const fvec noise = fvec(0.0f) - fvec::loadu(u).log1p();
    (fvec::loadu(e + i) / noise).store(r + i);
  }
}

// The first index of the largest r among the tokens whose e is above `pivot`.
int64_t race_winner(const float* e, const float* r, int64_t padded, float pivot) {
  const fvec p(pivot), none(-1.0f);
  fvec best = none;
  for (int64_t i = 0; i < padded; i += kLanes) {
    best = at::vec::maximum(best, fvec::blendv(none, fvec::loadu(r + i), fvec::loadu(e + i) > p));
  }
  const float most = reduce_max(best);
  for (int64_t i = 0; i < padded; ++i) {
    if (e[i] > pivot && r[i] == most) return i;
  }
  return 0;  // only where a NaN made every comparison false (drawable rows have none)
}

// The race's last resort: the tokens above the pivot in order, top-p's prefix and min-p's
// kept, the largest ratio among them (the first, in that order, on a tie).
int64_t race_sorted(const float* e, const float* r, int64_t n, float pivot, double sum,
                    const RowParams& row) {
  std::vector<int64_t> above;
  for (int64_t i = 0; i < n; ++i) {
    if (e[i] > pivot) above.push_back(i);
  }
  if (above.empty()) return std::max_element(e, e + n) - e;  // top_p 0: nothing is kept
  std::stable_sort(above.begin(), above.end(), [&](int64_t a, int64_t b) { return e[a] > e[b]; });
  double mass = 0.0;
  int64_t winner = above.front();
  float most = -1.0f;
  for (int64_t i : above) {
    if (mass >= row.top_p * sum) break;
    mass += e[i];
    if (e[i] >= row.min_p && r[i] > most) {
      most = r[i];
      winner = i;
    }
  }
  return winner;
}

template <typename T>
int64_t race_row(const T* logits, int64_t n, const RowParams& row, uint64_t key,
                 int64_t max_rounds, std::vector<float>& buffer) {
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  buffer.resize(2 * padded);
  float* e = buffer.data();
  float* r = e + padded;
  const bool nucleus = row.top_p < 1.0f;
  fill_numerators(logits, n, row_max(logits, n), row.inv_temperature, nucleus ? 0.0f : row.min_p,
                  e);
  const double sum = total_above(e, padded, 0.0f);
  if (!drawable(sum)) return degenerate_row(logits, n);
  fill_ratios(e, padded, key, r);
  if (!nucleus) return race_winner(e, r, padded, 0.0f);
  float pivot = 0.0f;
  double weight = sum;  // of the e above the pivot
  for (int64_t round = 0; round < max_rounds; ++round) {
    const int64_t winner = race_winner(e, r, padded, pivot);
    const float chosen = e[winner];
    // The e above the winner weigh at most those above the pivot less its own: where that
    // bound settles top-p, their sum is not taken.
    const bool settled = weight - chosen < row.top_p * sum;
    if (settled && chosen >= row.min_p) return winner;
    weight = total_above(e, padded, chosen);
    if (weight < row.top_p * sum && chosen >= row.min_p) return winner;
    pivot = chosen;
  }
  return race_sorted(e, r, n, pivot, sum, row);
}

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

at::Tensor race_rows(const at::Tensor& logits, const at::Tensor& temperature,
                     const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& keys,
                     int64_t max_rounds) {
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.is_contiguous() &&
                  keys.numel() == logits.size(0),
              "race_rows: keys must be int64 [rows]");
  const int64_t* k = keys.const_data_ptr<int64_t>();
  return draw_rows("race_rows", logits, temperature, top_p, min_p, max_rounds,
                   [&](const auto* row_logits, int64_t n, const RowParams& row, int64_t r,
                       std::vector<float>& buffer) {
                     return race_row(row_logits, n, row, static_cast<uint64_t>(k[r]),
                                     max_rounds, buffer);
                   });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def(
      "sample_rows(Tensor logits, Tensor temperature, Tensor top_p, Tensor min_p, "
      "Tensor uniforms, int max_rounds) -> Tensor");
  m.def(
      "race_rows(Tensor logits, Tensor temperature, Tensor top_p, Tensor min_p, Tensor keys, "
      "int max_rounds) -> Tensor");
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) {
  m.impl("sample_rows", &sample_rows);
  m.impl("race_rows", &race_rows);
}

}  // namespace duoserve
