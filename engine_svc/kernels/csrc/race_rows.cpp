// Random sampling for seeded rows without top-k: the exponential race of
// engine_svc/worker/seeded_sampling.py. Each token's Exp(1) number E is hashed from the row's
// key and the token id, there and here alike (the integer steps bit for bit; -log1p(-w)
// through the vectorized log1p torch's CPU log1p runs), and the winner is the largest e / E
// among the kept tokens, kept as sample_rows.cpp keeps them (top-p by rejection over a pivot,
// then min-p), over the row's numerators (sampling_rows.h). Filling a row's 49,152 numbers
// from a seeded torch.Generator took 0.88 ms; here the hash, the logarithm and the ratios are
// one pass over the row in L2.

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
      "race_rows(Tensor logits, Tensor temperature, Tensor top_p, Tensor min_p, Tensor keys, "
      "int max_rounds) -> Tensor");
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) { m.impl("race_rows", &race_rows); }

}  // namespace duoserve
