// The logprobs a request asks for, from the raw logits ([rows, vocab] float32 or bfloat16):
// each row's chosen token's log-probability and rank (1 + the tokens more likely), and its
// num_top most likely tokens with theirs, without the [rows, vocab] log_softmax.
//
// In torch the sampler took the float32 copy, log_softmax, a comparison and sum for the
// ranks and a topk: 24-28 ms a decode step at 64 rows of SmolLM2's 49,152 tokens on the
// 2-core Xeon with AMX, more than half the forward. Here a thread reads each of its rows
// three times from L2: its maximum, the sum of exp(l - max), then the log-probabilities
// (l - max) - log(sum), as torch's log_softmax computes them, counted against the chosen
// one's and kept while they beat the num_top-th best so far.

#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace duoserve {
namespace {

template <typename T>
float sum_of_exp(const T* row, int64_t n, float max) {
  const fvec shift(max);
  fvec sums(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) sums = sums + (load_lanes(row + i) - shift).exp();
  float result = reduce_add(sums);
  for (; i < n; ++i) result += std::exp(static_cast<float>(row[i]) - max);
  return result;
}

// The best num_top (log-probability, token) pairs seen so far, best first; a tie keeps the
// lower token id first.
class TopTokens {
 public:
  explicit TopTokens(int64_t size) : size_(size) { best_.reserve(size + 1); }

  // The value a token must beat to enter (-inf while there is room).
  float threshold() const {
    return static_cast<int64_t>(best_.size()) < size_
               ? -std::numeric_limits<float>::infinity()
               : best_.back().first;
  }

  void offer(float value, int64_t token) {
    if (size_ == 0) return;
    if (static_cast<int64_t>(best_.size()) == size_ && !(value > best_.back().first)) return;
    auto at = std::upper_bound(
        best_.begin(), best_.end(), value,
        [](float v, const std::pair<float, int64_t>& entry) { return v > entry.first; });
    best_.insert(at, {value, token});
    if (static_cast<int64_t>(best_.size()) > size_) best_.pop_back();
  }

  const std::vector<std::pair<float, int64_t>>& best() const { return best_; }

 private:
  int64_t size_;
  std::vector<std::pair<float, int64_t>> best_;
};

struct RowLogprobs {
  float chosen;
  int64_t rank;
};

template <typename T>
RowLogprobs row_logprobs(const T* row, int64_t n, int64_t token, TopTokens& top) {
  const float max = row_max(row, n);
  const float log_sum = std::log(sum_of_exp(row, n, max));
  auto logprob = [&](float logit) { return logit - max - log_sum; };
  const float chosen = logprob(static_cast<float>(row[token]));
  const fvec shift(max), norm(log_sum), target(chosen);
  int64_t above = 0;
  __at_align__ float values[kLanes];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const fvec v = load_lanes(row + i) - shift - norm;
    above += kLanes - __builtin_popcount((v > target).zero_mask());  // lanes above it
    const float floor = top.threshold();
    if (reduce_max(v) > floor || floor == -std::numeric_limits<float>::infinity()) {
      v.store(values);
      for (int64_t j = 0; j < kLanes; ++j) top.offer(values[j], i + j);
    }
  }
  for (; i < n; ++i) {
    const float v = logprob(static_cast<float>(row[i]));
    above += v > chosen;
    top.offer(v, i);
  }
  return {chosen, above + 1};
}

template <typename T>
void logprobs_of(const at::Tensor& logits, const int64_t* tokens, int64_t num_top,
                 float* chosen, int64_t* ranks, float* top_values, int64_t* top_ids) {
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  const T* base = logits.const_data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      TopTokens top(num_top);
      const RowLogprobs row = row_logprobs(base + r * stride, n, tokens[r], top);
      chosen[r] = row.chosen;
      ranks[r] = row.rank;
      const auto& best = top.best();
      for (int64_t k = 0; k < num_top; ++k) {
        top_values[r * num_top + k] = best[k].first;
        top_ids[r * num_top + k] = best[k].second;
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_logprobs(
    const at::Tensor& logits, const at::Tensor& tokens, int64_t num_top) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
              "token_logprobs: logits must be [rows, vocab], rows contiguous");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous() &&
                  tokens.numel() == rows,
              "token_logprobs: tokens must be int64 [rows]");
  TORCH_CHECK(num_top >= 0 && num_top <= vocab, "token_logprobs: num_top must be in [0, vocab]");
  const int64_t* token_ptr = tokens.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(token_ptr[r] >= 0 && token_ptr[r] < vocab, "token_logprobs: tokens[", r,
                "] is out of range");
  }
  const auto floats = logits.options().dtype(at::kFloat);
  const auto longs = logits.options().dtype(at::kLong);
  auto chosen = at::empty({rows}, floats);
  auto ranks = at::empty({rows}, longs);
  auto top_values = at::empty({rows, num_top}, floats);
  auto top_ids = at::empty({rows, num_top}, longs);
  float* c = chosen.mutable_data_ptr<float>();
  int64_t* k = ranks.mutable_data_ptr<int64_t>();
  float* v = top_values.mutable_data_ptr<float>();
  int64_t* i = top_ids.mutable_data_ptr<int64_t>();
  if (logits.scalar_type() == at::kFloat) {
    logprobs_of<float>(logits, token_ptr, num_top, c, k, v, i);
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16,
                "token_logprobs: logits must be float32 or bfloat16");
    logprobs_of<at::BFloat16>(logits, token_ptr, num_top, c, k, v, i);
  }
  return {chosen, ranks, top_values, top_ids};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def(
      "token_logprobs(Tensor logits, Tensor tokens, int num_top) -> (Tensor, Tensor, Tensor, "
      "Tensor)");
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) { m.impl("token_logprobs", &token_logprobs); }

}  // namespace duoserve
