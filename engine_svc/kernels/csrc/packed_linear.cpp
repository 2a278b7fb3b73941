// Linear layers over weights packed once, at load time (float32).
//
// torch's matmul hands each call to MKL's sgemm, which copies the weight into its panel
// layout every time; at decode's row counts (one row per running sequence) that copy is a
// large part of the work. Here the weight is stored already cut into column blocks,
// [ceil(N / block), K, block] (the last block zero-padded), so each block is one contiguous
// K x block panel, read as is. Threads split the column blocks.
//
// On AVX-512, 3 to 128 rows (decode steps), a register-tile kernel of our own (gemm_tile.h,
// one source for AVX-512, AVX2 and NEON) computes a panel while it prefetches the thread's
// next panel into L2, spread over its loop: the weights stream from memory at every step, and
// oneDNN's brgemm, which does not prefetch, stalled on each panel's first pass there. More
// rows (prefill), and from 9 rows on AVX2, brgemm (oneDNN's batch-reduce GEMM kernel,
// through ATen's cpublas) over row tiles of 256, which keep the activations in cache while a
// thread sweeps its blocks. Up to 8 rows on AVX2 and 2 on AVX-512, a GEMV of our own
// (panel_gemv.h) that streams several panels at once (kMaxGemvRows). Measured
// with SmolLM2-135M's shapes, 30 layers and the LM head with weights streaming from memory,
// on the 2-core machines this project runs on:
// - Intel Xeon, AVX-512: MKL 97-108 ms at 64 rows, brgemm 75-90, the register tile 69-76
//   (1 row: brgemm 25-32, the tile 23-26); a 2,048-token prefill on par with MKL (313 GFLOP/s).
// - AMD EPYC (Zen 3), AVX2 only, alternating runs: brgemm 142-189 ms at 64 rows against the
//   tile's 162-250 (MKL 308), 28-31 ms against 37-50 at 1 row, 72-92 against 115-139 at 32.
//   Its hardware prefetchers keep brgemm fed; the tile (12 accumulators in 16 registers)
//   is the slower of the two at every row count there.
// - AMD EPYC (Zen 4), one row: the 120 decoder projections stream their weights at 25.5 GB/s
//   through the tile against 31-32 for one 512 MB weight (the shorter the call, the slower:
//   qkv and o 21-24). Each thread requesting its first panel of the next call into L2 during
//   its last panel of this one measured no faster (0.97-1.03x, four alternating rounds). The
//   GEMV's four panels side by side were: see kMaxGemvRows.
//
// The sums run in another order than MKL's, so results differ from torch's by float
// rounding (relative 1e-6), as two BLAS libraries do.

#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "gemm_tile.h"
#include "panel_gemv.h"
#include "stealing.h"

namespace duoserve {
namespace {

constexpr int64_t kRowTile = 256;
// Row counts the register tile takes; above, brgemm (the measured crossovers above).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kMaxRegisterTileRows = 128;
#else
constexpr int64_t kMaxRegisterTileRows = 0;
#endif
// Up to kMaxGemvRows rows (a decode step of a few requests): a GEMV of our own (panel_gemv.h),
// summing in brgemm's order with FMA, as the tile does. On AVX2 brgemm paid a fixed set-up
// per panel call that a GEMV's streaming does not hide: on the Zen 3, SmolLM2's 120 decoder
// projections at 2 rows took 13.0-16.3 ms here against 18.7-21.2 through brgemm, at 6 rows
// 18.9-21.6 against 22.3-24.7, at 8 alike (23.1-23.8 against 23.6-26.0), and at 12 brgemm was
// faster (three alternating rounds in one process). On AVX-512 the GEMV reads up to four panels
// side by side (3-4 for two rows, 4 for one; one pass for up to two rows) where the tile reads
// one and prefetches the next: on the Zen 4, greedy requests decoding together in one process,
// alternating the two paths round by round (128 tokens a round), took 0.76-0.99x the tile's
// time a token alone (four runs of 6-10 rounds; medians 15.0 against 18.2 ms, 15.8 against
// 18.9, 17.3 against 19.9, 19.4 against 20.6) and 0.76-0.82x two at a time, but 0.98-1.15x
// three at a time and 0.98-1.10x four (the rows past two are a second pass over the panels);
// not measured on the Xeon. The plain-C++ level has no FMA instruction to match brgemm's sums
// with, and keeps brgemm (no rows through the GEMV).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kMaxGemvRows = 2;
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kMaxGemvRows = 8;
#else
constexpr int64_t kMaxGemvRows = 0;
#endif


// weight: [N, K] (nn.Linear's layout), zero-padded to whole blocks of columns:
// - float32 -> [ceil(N / block), K, block]: each block a contiguous K x block panel.
// - bfloat16 -> [ceil(N / block), ceil(K / 2), block, 2]: each panel in pairs of k, a pair
//   row holding each column's two consecutive k side by side (K zero-padded to even), so
//   that one vector load widens into two k's worth of float32 columns (load_bf16_pairs).
at::Tensor pack_linear_weight(const at::Tensor& weight, int64_t block) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [out_features, in_features]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "packed linear weights are float32 or bfloat16");
  TORCH_CHECK(block >= 1, "block must be >= 1");
  const int64_t n = weight.size(0);
  const int64_t k = weight.size(1);
  const int64_t num_blocks = (n + block - 1) / block;
  if (weight.scalar_type() == at::kFloat) {
    auto padded = at::zeros({num_blocks * block, k}, weight.options());
    padded.narrow(0, 0, n).copy_(weight);
    // [blocks, block, K] -> [blocks, K, block]
    return padded.view({num_blocks, block, k}).transpose(1, 2).contiguous();
  }
  const int64_t pairs = (k + 1) / 2;
  auto padded = at::zeros({num_blocks * block, 2 * pairs}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  // [blocks, block, K / 2, 2] -> [blocks, K / 2, block, 2]
  return padded.view({num_blocks, block, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

// A float32 [K, block] panel as brgemm reads it: float32 weights as they are; bfloat16 ones
// (in pairs of k) widened into the thread's scratch first (exact), once per row tile.
inline const float* float_panel(const float* panel, int64_t, int64_t, std::vector<float>&) {
  return panel;
}

inline const float* float_panel(const at::BFloat16* panel, int64_t k, int64_t block,
                                std::vector<float>& scratch) {
  scratch.resize(k * block);
  for (int64_t kk = 0; kk < k; kk += 2) {
    const at::BFloat16* pairs = panel + kk * block;  // pair row kk / 2
    float* first = scratch.data() + kk * block;
    float* second = first + block;
    const bool has_second = kk + 1 < k;  // else the pair's second value is padding
    int64_t col = 0;
    for (; col + kLanes <= block; col += kLanes) {
      vreg first_k, second_k;
      load_bf16_pairs(pairs + 2 * col, first_k, second_k);
      fvec(first_k).store(first + col);
      if (has_second) fvec(second_k).store(second + col);
    }
    for (; col < block; ++col) {
      first[col] = static_cast<float>(pairs[2 * col]);
      if (has_second) second[col] = static_cast<float>(pairs[2 * col + 1]);
    }
  }
  return scratch.data();
}

// C = A . W (+ bias) with brgemm, row tiles of kRowTile over the threads' column blocks.
// float32 results land in C; bfloat16 ones (C of bfloat16) in a float32 tile of the thread's,
// rounded into C while the tile is in cache (to nearest even, as torch's conversion rounds).
// Each row tile's blocks are handed out as a static split would, and a thread done with its
// share of a tile takes blocks from the back of the other's before it goes on to the next
// tile (stealing.h): a thread that loses its core holds up a panel, not the whole call. A
// panel's sums do not depend on which thread computes it.
template <typename W, typename O>
void brgemm_rows(const float* a, int64_t lda, int64_t m, const W* weights, int64_t num_blocks,
                 int64_t k, int64_t block, const float* bias, O* c, int64_t n) {
  constexpr bool kRounded = std::is_same_v<O, at::BFloat16>;
  const int64_t num_tiles = (m + kRowTile - 1) / kRowTile;
  parallel_stealing_rounds(num_tiles, num_blocks, [&](RoundsCursor& cursor) {
    std::vector<float> scratch, rounded_tile;
    if (kRounded) rounded_tile.resize(std::min(kRowTile, m) * block);
    for (auto [row_tile, b] = cursor.next(); b >= 0; std::tie(row_tile, b) = cursor.next()) {
      const int64_t m0 = row_tile * kRowTile;
      const int64_t rows = std::min(kRowTile, m - m0);
      const int64_t n0 = b * block;
      const int64_t cols = std::min(block, n - n0);
      float* tile;
      int64_t ldc;
      if constexpr (kRounded) {
        tile = rounded_tile.data();
        ldc = block;
      } else {
        tile = c + m0 * n + n0;
        ldc = n;
      }
      if (bias != nullptr) {  // C starts as the bias, as addmm's beta = 1 does
        for (int64_t r = 0; r < rows; ++r) std::copy_n(bias + n0, cols, tile + r * ldc);
      }
      const float* panel = float_panel(weights + b * panel_size<W>(k, block), k, block, scratch);
      at::native::cpublas::brgemm(rows, cols, k, lda, block, ldc, bias != nullptr, a + m0 * lda,
                                  panel, tile, /*is_vnni=*/false);
      if constexpr (kRounded) {
        for (int64_t r = 0; r < rows; ++r) {
          at::vec::convert(tile + r * ldc, c + (m0 + r) * n + n0, cols);
        }
      }
    }
    at::native::cpublas::brgemm_release(/*is_vnni=*/false);
  });
}

// bfloat16 weights where torch's bfloat16 matmul runs a scalar loop (AVX2, where oneDNN has
// no bfloat16 kernel: 1.2 GFLOP/s at 64 rows, 70x slower than float32). Half the bytes stream
// from memory, each panel is widened to float32 in cache, and the products and sums run in
// float32, rounded to bfloat16 once at the end, as torch's bfloat16 matmul rounds.
// One row in bfloat16 and out in bfloat16, widened into and rounded from per-thread buffers
// rather than float32 tensors: at a decode step's small projections (576 x 576) the three
// conversions and their allocations took longer than the product from cache.
bool gemv_bf16_row(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                   const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t block = packed.size(2);
  const int64_t vectors = block % kLanes == 0 ? block / kLanes : 0;
  if (x.size(0) != 1 || vectors < 2 || vectors > 4) return false;
  const int64_t k = x.size(1);
  thread_local std::vector<float> a, bias32;
  a.resize(k);
  widen_bf16(x.contiguous().data_ptr<at::BFloat16>(), a.data(), k);
  if (bias.has_value()) {
    bias32.resize(packed.size(0) * block);
    widen_bf16(bias->data_ptr<at::BFloat16>(), bias32.data(), n);
  }
  out = at::empty({1, n}, x.options());
  return gemv_any(vectors, a.data(), k, 1, packed.data_ptr<at::BFloat16>(), packed.size(0), k,
                  bias.has_value() ? bias32.data() : nullptr, out.data_ptr<at::BFloat16>(), n);
}

at::Tensor packed_linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                              const std::optional<at::Tensor>& bias) {
  at::Tensor row_out;
  if (gemv_bf16_row(x, packed, n, bias, row_out)) return row_out;
  const int64_t m = x.size(0), k = x.size(1);
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  // The rows widened over the threads, and the results rounded tile by tile in brgemm_rows:
  // torch's conversions (x.to(float32), out.to(bfloat16)) took ~11 ms of a 64-row decode
  // step's ~275 ms forward on the Zen 1.
  const at::Tensor rows = x.contiguous();
  auto a = at::empty({m, k}, x.options().dtype(at::kFloat));
  const at::BFloat16* x_ptr = rows.data_ptr<at::BFloat16>();
  float* a_ptr = a.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    widen_bf16(x_ptr + begin * k, a_ptr + begin * k, (end - begin) * k);
  });
  std::vector<float> bias32;
  if (bias.has_value()) {
    bias32.resize(n);
    widen_bf16(bias->data_ptr<at::BFloat16>(), bias32.data(), n);
  }
  brgemm_rows(a_ptr, k, m, packed.data_ptr<at::BFloat16>(), packed.size(0), k, packed.size(2),
              bias.has_value() ? bias32.data() : nullptr, out.data_ptr<at::BFloat16>(), n);
  return out;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  const auto dtype = packed.scalar_type();
  const bool pairs = dtype == at::kBFloat16;  // bfloat16 is packed in pairs of k
  TORCH_CHECK(packed.is_contiguous() && ((dtype == at::kFloat && packed.dim() == 3) ||
                                         (pairs && packed.dim() == 4 && packed.size(3) == 2)),
              "packed must be pack_linear_weight's: contiguous float32 [blocks, in_features, "
              "block] or bfloat16 [blocks, in_features / 2 rounded up, block, 2]");
  const char* dtype_name = pairs ? "bfloat16" : "float32";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype, "x must be ", dtype_name,
              " [rows, in], the packed weight's dtype");
  const int64_t m = x.size(0);
  const int64_t k = x.size(1);
  const int64_t block = packed.size(2);
  const int64_t n = out_features;
  TORCH_CHECK(packed.size(1) == (pairs ? (k + 1) / 2 : k), "x has ", k,
              " features, the weight takes ",
              pairs ? std::to_string(2 * packed.size(1) - 1) + " or " : std::string(),
              pairs ? 2 * packed.size(1) : packed.size(1));
  TORCH_CHECK(n >= 1 && n <= packed.size(0) * block && n > (packed.size(0) - 1) * block,
              "out_features does not match the packed weight");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n && bias->scalar_type() == dtype &&
                    bias->is_contiguous(),
                "bias must be contiguous ", dtype_name, " [out_features]");
  }
  if (dtype == at::kBFloat16) return packed_linear_bf16(x, packed, n, bias);
  const at::Tensor a = x.stride(1) == 1 ? x : x.contiguous();
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;

  const float* a_ptr = a.data_ptr<float>();
  const int64_t lda = a.stride(0);
  const float* b_ptr = packed.data_ptr<float>();
  const float* bias_ptr = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* c_ptr = out.data_ptr<float>();
  const int64_t vectors = block % kLanes == 0 ? block / kLanes : 0;
  if (m <= kMaxGemvRows &&
      gemv_any(vectors, a_ptr, lda, m, b_ptr, packed.size(0), k, bias_ptr, c_ptr, n)) {
    return out;
  }
  if (m <= kMaxRegisterTileRows && vectors >= 2 && vectors <= kPanelVectors) {
    parallel_stealing(packed.size(0), [&](StealingCursor& cursor) {
      for (int64_t b = cursor.next(); b >= 0; b = cursor.next()) {
        const float* panel = b_ptr + b * k * block;
        const float* next = cursor.continues_with(b + 1) ? panel + k * block : nullptr;
        const float* panel_bias = bias_ptr != nullptr ? bias_ptr + b * block : nullptr;
        const int64_t cols = std::min(block, n - b * block);
        panel_rows_any(vectors, a_ptr, lda, m, panel, k, panel_bias, c_ptr + b * block, n, cols,
                       next);
      }
    });
    return out;
  }
  brgemm_rows(a_ptr, lda, m, b_ptr, packed.size(0), k, block, bias_ptr, c_ptr, n);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def("pack_linear_weight(Tensor weight, int block) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
}

}  // namespace duoserve
