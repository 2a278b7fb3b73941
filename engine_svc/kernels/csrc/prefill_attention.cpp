// Causal self-attention of prompt chunks that have no cached context, for CPU: all of a
// step's chunks in one call (float32 or bfloat16, computed in float32; head_dim a multiple
// of the key panel: 64 floats on AVX-512, 16 on AVX2 and NEON).
//
// torch's SDPA took one call per chunk per layer, and its flash kernel is slow at prompt
// sizes (16 chunks of 64-192 tokens: 8-9.5 ms per layer). Here every chunk's keys are laid
// out once, as panels of transposed keys, and its values as contiguous [keys x panel] panels
// (lay_out_chunks); then a task is (chunk, KV head, 64 query rows), handed out longest
// first, and for each query head of the KV head runs two small GEMMs through the
// register-tile kernel (gemm_tile.h):
// S = Q K^T, a causal softmax per row (scaled, max-subtracted, normalized), and O = P V.
// With a sliding window (window > 0), query i attends to keys (i - window, i] only: a task
// reads the keys from the panel holding its first row's window start, and masks the rest row
// by row.
//
// bfloat16 on AMX (attend_chunks_amx): both products as AMX tile products over bfloat16
// pairs instead, the softmax and roundings unchanged. 16 chunks of 128 tokens, SmolLM2's 9
// heads on 3 KV heads, one layer: 1.66-1.80 ms against 3.15-3.19 (processes alternating),
// outputs equal to torch's flash attention's as often (91%).

#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "gemm_tile.h"
#include "prefill_attention_amx.h"
#include "prefill_tasks.h"

namespace duoserve {
namespace {

using namespace prefill;

inline float widened(float x) { return x; }
inline float widened(at::BFloat16 x) { return static_cast<float>(x); }

// The float32 path's layouts (and bfloat16's without AMX, widened as they are laid out): the
// keys as panels of transposed keys, [key panel][dim][kPanel keys], the values as
// [dim panel][key][kPanel].
using ChunkLayouts = Layouts<float>;

template <typename T>
ChunkLayouts lay_out_chunks(const at::Tensor& k, const at::Tensor& v, const int32_t* start_ptr,
                            const int32_t* len_ptr, int64_t num_chunks) {
  ChunkLayouts layouts(k, len_ptr, num_chunks);
  const int64_t kv_heads = k.size(1), dim = layouts.dim;
  const auto& units = layouts.units;
  const T* k_ptr = k.data_ptr<T>();
  const T* v_ptr = v.data_ptr<T>();
  const int64_t dim_panels = dim / kPanel;
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const auto [c, panel] = units[u];
      const int64_t width = layouts.width[c];
      for (int64_t h = 0; h < kv_heads; ++h) {
        float* keys_t = layouts.keys_of(c, h) + panel * dim * kPanel;
        float* values = layouts.values_of(c, h);
        for (int64_t lane = 0; lane < kPanel; ++lane) {
          const int64_t key = panel * kPanel + lane;
          if (key >= len_ptr[c]) {  // padding: zeros, so padded products are 0
            for (int64_t d = 0; d < dim; ++d) keys_t[d * kPanel + lane] = 0.0f;
            for (int64_t p = 0; p < dim_panels; ++p) {
              std::fill_n(values + (p * width + key) * kPanel, kPanel, 0.0f);
            }
            continue;
          }
          const int64_t token = start_ptr[c] + key;
          const T* k_row = k_ptr + token * k.stride(0) + h * k.stride(1);
          const T* v_row = v_ptr + token * v.stride(0) + h * v.stride(1);
          for (int64_t d = 0; d < dim; ++d) keys_t[d * kPanel + lane] = widened(k_row[d]);
          for (int64_t p = 0; p < dim_panels; ++p) {
            float* dst = values + (p * width + key) * kPanel;
            if constexpr (std::is_same_v<T, float>) {
              std::copy_n(v_row + p * kPanel, kPanel, dst);
            } else {
              widen_bf16(v_row + p * kPanel, dst, kPanel);
            }
          }
        }
      }
    }
  });
  return layouts;
}

// out, q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] (strided views, such
// as the fused qkv projection's); chunk i is tokens [starts[i], starts[i] + lens[i]). T is
// float or at::BFloat16: bfloat16 is widened as the keys, values and query rows are laid
// out and the math runs in float32, with P rounded to bfloat16 as torch's flash attention
// rounds it (causal_softmax) and each output row rounded once at the end.
template <typename T>
void attend_chunks(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const int32_t* start_ptr, const int32_t* len_ptr, int64_t num_chunks,
                   int64_t max_len, double scale, int64_t window) {
  constexpr bool kWiden = !std::is_same_v<T, float>;
  const int64_t heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  const ChunkLayouts layouts = lay_out_chunks<T>(k, v, start_ptr, len_ptr, num_chunks);
  const std::vector<Task> tasks = longest_first_tasks(len_ptr, num_chunks, kv_heads);
  const int64_t group = heads / kv_heads;
  const int64_t max_keys = (max_len + kPanel - 1) / kPanel * kPanel;
  const int64_t dim_panels = dim / kPanel;
  std::atomic<int64_t> next_task{0};
  const T* q_ptr = q.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores(kTaskRows * max_keys);  // [query row][key]
    // bfloat16: one query head's rows of the task, widened, and their float32 results.
    std::vector<float> query(kWiden ? kTaskRows * dim : 0);
    std::vector<float> result(kWiden ? kTaskRows * dim : 0);
    float inv_sums[kTaskRows];
    for (int64_t index = next_task++; index < static_cast<int64_t>(tasks.size());
         index = next_task++) {
      const Task& task = tasks[index];
      const int64_t start = start_ptr[task.chunk];
      const auto [rows, first_key, width] = task_span(task, len_ptr, window);
      const int64_t chunk_width = layouts.width[task.chunk];
      const float* keys_t = layouts.keys_of(task.chunk, task.kv_head) + first_key * dim;
      const float* values = layouts.values_of(task.chunk, task.kv_head) + first_key * kPanel;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = task.kv_head * group + g;
        const T* q_rows = q_ptr + (start + task.first_row) * q.stride(0) + head * q.stride(1);
        T* out_rows = out_ptr + (start + task.first_row) * out.stride(0) + head * out.stride(1);
        const float* a = nullptr;
        int64_t lda = 0, ldc = 0;
        float* c = nullptr;
        if constexpr (kWiden) {
          for (int64_t i = 0; i < rows; ++i) {
            widen_bf16(q_rows + i * q.stride(0), query.data() + i * dim, dim);
          }
          a = query.data(), lda = dim, c = result.data(), ldc = dim;
        } else {
          a = q_rows, lda = q.stride(0), c = out_rows, ldc = out.stride(0);
        }
        for (int64_t panel = 0; panel < width / kPanel; ++panel) {
          panel_rows<kAttentionVectors>(a, lda, rows, keys_t + panel * dim * kPanel, dim,
                                        nullptr, scores.data() + panel * kPanel, width, kPanel,
                                        nullptr);
        }
        causal_softmax(scores.data(), rows, task.first_row, first_key, width, window,
                       static_cast<float>(scale), kWiden ? inv_sums : nullptr);
        for (int64_t panel = 0; panel < dim_panels; ++panel) {
          panel_rows<kAttentionVectors>(scores.data(), width, rows,
                                        values + panel * chunk_width * kPanel, width, nullptr,
                                        c + panel * kPanel, ldc, kPanel, nullptr);
        }
        if constexpr (kWiden) {
          normalize_rows(result.data(), rows, dim, inv_sums, out_rows, out.stride(0));
        }
      }
    }
  });
}

void prefill_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& starts, const at::Tensor& lens,
                        double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.sizes() == q.sizes(),
              "prefill_attention: q and out must be [tokens, heads, head_dim], k and v "
              "[tokens, kv_heads, head_dim]");
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k.scalar_type() == dtype &&
                  v.scalar_type() == dtype && out.scalar_type() == dtype,
              "prefill_attention: q, k, v and out must all be float32 or all bfloat16");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "prefill_attention: head_dim must be contiguous");
  const int64_t heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == dim && k.size(0) == q.size(0) &&
                  heads % kv_heads == 0,
              "prefill_attention: k and v must match q's tokens and head_dim");
  TORCH_CHECK(dim % kPanel == 0, "prefill_attention: head_dim must be a multiple of ", kPanel,
              " in this build");
  TORCH_CHECK(starts.scalar_type() == at::kInt && lens.scalar_type() == at::kInt &&
                  starts.is_contiguous() && lens.is_contiguous() &&
                  starts.numel() == lens.numel(),
              "prefill_attention: starts and lens must be contiguous int32 of one length");
  TORCH_CHECK(window >= 0, "prefill_attention: window must be 0 (none) or positive");
  const int32_t* start_ptr = starts.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  int64_t max_len = 0;
  for (int64_t c = 0; c < starts.numel(); ++c) {
    TORCH_CHECK(start_ptr[c] >= 0 && len_ptr[c] >= 1 && start_ptr[c] + len_ptr[c] <= q.size(0),
                "prefill_attention: chunk ", c, " is out of range");
    max_len = std::max<int64_t>(max_len, len_ptr[c]);
  }
  if (dtype == at::kFloat) {
    attend_chunks<float>(out, q, k, v, start_ptr, len_ptr, starts.numel(), max_len, scale, window);
  } else {
#if DUOSERVE_AMX_TILES
    if (dim % kTileK == 0 && amx_permitted()) {
      attend_chunks_amx(out, q, k, v, start_ptr, len_ptr, starts.numel(), max_len, scale,
                        window);
      return;
    }
#endif
    attend_chunks<at::BFloat16>(out, q, k, v, start_ptr, len_ptr, starts.numel(), max_len, scale,
                                window);
  }
}

int64_t prefill_attention_panel() { return kPanel; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def("prefill_attention_panel() -> int", &prefill_attention_panel);
  m.def(
      "prefill_attention_(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor starts, "
      "Tensor lens, float scale, int window=0) -> ()");
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) { m.impl("prefill_attention_", &prefill_attention_); }

}  // namespace duoserve
