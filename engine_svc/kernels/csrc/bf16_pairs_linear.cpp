// bfloat16 projections for decode's row counts on AVX512-BF16 (vdpbf16ps) and, where the
// CPU has them, AMX's tiles, over weights packed once in pairs of k.
//
// oneDNN's prepacked bfloat16 GEMM runs near the FMA units' peak when its weights are in
// cache, but in a decode step every projection's weights stream from memory, and its kernel
// does not fetch ahead: SmolLM2-135M's 120 decoder projections at 64 rows took 19 ms with
// the weights streaming against 14.5 with them in cache (the Zen 5), about the time the
// 212 MB take to arrive. Here, as the float32 register tile does (gemm_tile.h), each panel
// of columns is computed while the thread's next panel is requested into L2, spread over the
// loop.
//
// Layout: [ceil(N / block), K / 2, block, 2]: each panel is K / 2 steps of `block` columns
// times two consecutive k, so one 64-byte vector holds 16 columns' pairs, what vdpbf16ps
// multiplies by a broadcast pair of the row's k. The sums run in float32 in k order, a pair
// at a time, each output in one accumulator; the bias is added to the sum and the result
// rounded to bfloat16 once, at the end.

#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#if DUOSERVE_AMX_TILES
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace duoserve {
namespace {

// Columns per panel: two vectors of 16.
constexpr int64_t kPairsBlock = 32;

at::Tensor pack_bf16_pairs(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be bfloat16 [out_features, in_features]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % 2 == 0, "in_features must be even, got ", k);
  const int64_t blocks = (n + kPairsBlock - 1) / kPairsBlock;
  auto padded = at::zeros({blocks * kPairsBlock, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [blocks, block, K / 2, 2] -> [blocks, K / 2, block, 2]
  return padded.view({blocks, kPairsBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)

constexpr int kVecs = kPairsBlock / 16;
constexpr int kMaxRows = 12;  // 24 accumulators, 2 panel vectors and the broadcast pair

// The first `cols` lanes of a vector of columns (none where cols <= 0).
inline __mmask16 column_mask(int64_t cols) {
  return static_cast<__mmask16>((1u << std::clamp<int64_t>(cols, 0, 16)) - 1u);
}

// The bias of a vector of columns, or zeros without one.
inline __m512 bias_lanes(const float* bias, __mmask16 mask) {
  return bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
}

// A vector of sums plus the bias (where there is one: -0 stays -0 without), rounded to
// bfloat16 once, into c's lanes under mask.
inline void store_rounded(__m512 sum, bool has_bias, __m512 bias, __mmask16 mask,
                          at::BFloat16* c) {
  if (has_bias) sum = _mm512_add_ps(sum, bias);
  _mm256_mask_storeu_epi16(c, mask, (__m256i)_mm512_cvtneps_pbh(sum));
}

template <int kRows>
void pairs_tile(const at::BFloat16* __restrict a, int64_t lda, const at::BFloat16* __restrict panel,
                int64_t pairs, const float* __restrict bias, at::BFloat16* __restrict c,
                int64_t ldc, int64_t cols, const char* next, int64_t prefetch) {
  __m512 acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  const int64_t per_step = (prefetch + pairs - 1) / pairs;
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t line = p * per_step; line < std::min(prefetch, (p + 1) * per_step); ++line) {
      prefetch_l2(next + 64 * line);
    }
    __m512bh b[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      b[v] = (__m512bh)_mm512_loadu_si512(panel + (p * kVecs + v) * 32);
    }
    for (int r = 0; r < kRows; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof(pair));
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, b[v]);
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    const __mmask16 mask = column_mask(cols - 16 * v);
    const __m512 add = bias_lanes(bias == nullptr ? nullptr : bias + 16 * v, mask);
    for (int r = 0; r < kRows; ++r) {
      store_rounded(acc[r][v], bias != nullptr, add, mask, c + r * ldc + 16 * v);
    }
  }
}

template <int kRows = kMaxRows>
void pairs_tile_rows(int64_t rows, const at::BFloat16* a, int64_t lda,
                     const at::BFloat16* panel, int64_t pairs, const float* bias,
                     at::BFloat16* c, int64_t ldc, int64_t cols, const char* next,
                     int64_t prefetch) {
  if constexpr (kRows > 1) {
    if (rows < kRows) {
      pairs_tile_rows<kRows - 1>(rows, a, lda, panel, pairs, bias, c, ldc, cols, next,
                                 prefetch);
      return;
    }
  }
  pairs_tile<kRows>(a, lda, panel, pairs, bias, c, ldc, cols, next, prefetch);
}

void pairs_gemm(const at::BFloat16* a, int64_t lda, int64_t m, const at::BFloat16* packed,
                int64_t blocks, int64_t pairs, const float* bias, at::BFloat16* c,
                int64_t n) {
  const int64_t panel_size = pairs * kPairsBlock * 2;
  const int64_t lines = panel_size * 2 / 64;
  const int64_t tiles = (m + kMaxRows - 1) / kMaxRows;
  const int64_t share = (lines + tiles - 1) / tiles;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const at::BFloat16* panel = packed + b * panel_size;
      const char* next = b + 1 < end ? reinterpret_cast<const char*>(panel + panel_size) : nullptr;
      const int64_t cols = std::min(kPairsBlock, n - b * kPairsBlock);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = t * kMaxRows;
        const int64_t prefetch =
            next == nullptr ? 0 : std::clamp<int64_t>(lines - t * share, 0, share);
        pairs_tile_rows(std::min<int64_t>(kMaxRows, m - m0), a + m0 * lda, lda, panel, pairs,
                        bias != nullptr ? bias + b * kPairsBlock : nullptr,
                        c + m0 * n + b * kPairsBlock, n, cols,
                        next == nullptr ? nullptr : next + 64 * t * share, prefetch);
      }
    }
  });
}

#if DUOSERVE_AMX_TILES

// AMX: the same panels, multiplied by tiles. A B tile is 16 pairs of k by 16 columns, one
// 64-byte row a pair: half a pair row of a panel (pair rows lie a panel's 128 bytes apart),
// so the pairs layout is AMX's own and its panels are read as they lie. An A tile is 16 rows
// by 32 k, straight from the activations; a C tile holds 16 x 16 float32 sums. The k order is
// the dot-product kernel's. The hardware prefetchers keep up with the panels: requesting the
// next panel into L2, as the kernel above does, changed nothing measurable here.
//
// On the 2-core Xeon with AMX, SmolLM2-135M's 120 decoder projections and LM head with the
// weights on huge pages, streaming from memory (ms for all 121, alternating in one process):
// 16 rows 12.7-13.6 against oneDNN's prepacked 18.8-21.2; 64 rows 17.5-23.8 against
// 24.2-25.1; 512 rows 92-95 against 106; 2,048 rows 426-454 against oneDNN's 334-348
// (prompt steps keep oneDNN's copy where it fits). Under 4 rows the dot products
// (memory-bound, no tile set-up) are the faster: 2 rows 11.6-12.1 against 13.4-13.6.

constexpr int64_t kAmxMinRows = 4;
constexpr int64_t kTileRows = 16;
constexpr int64_t kTileK = 32;
// Rows a thread takes through all of its panels before the next rows: a prompt step's
// activations stay in L2 while the thread's panels pass by (2,048 rows in one chunk re-read
// them from L3 for every panel: the 121 projections 477-515 ms against 426-454 in chunks
// of 256 or 512).
constexpr int64_t kChunkRows = 256;

// The tile registers' shapes (palette 1), every tile 16 rows of 64 bytes: 0-3 sums (two
// row tiles by two column halves), 4-5 rows of A, 6-7 the panel's column halves.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux gives a process AMX's register state only when it asks for it (once, for every
// thread); where it refuses, the dot-product kernel serves.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// A C tile's sums (16 x 16 float32) plus the bias, rounded, into c's first `rows` rows and
// `cols` columns.
void store_sums(const float* __restrict sums, const float* __restrict bias,
                at::BFloat16* __restrict c, int64_t ldc, int64_t rows, int64_t cols) {
  const __mmask16 mask = column_mask(cols);
  const __m512 add = bias_lanes(bias, mask);
  for (int64_t r = 0; r < rows; ++r) {
    store_rounded(_mm512_loadu_ps(sums + r * 16), bias != nullptr, add, mask, c + r * ldc);
  }
}

// One panel's `cols` columns for rows [0, m) of a, whose rows up to m_padded (a multiple of
// 16) can be read.
void amx_panel(const at::BFloat16* a, int64_t lda, int64_t m, int64_t m_padded,
               const at::BFloat16* panel, int64_t pairs, const float* bias, at::BFloat16* c,
               int64_t ldc, int64_t cols, float* sums) {
  constexpr int64_t kPairRow = kPairsBlock * 2 * sizeof(at::BFloat16);
  const int64_t a_stride = lda * static_cast<int64_t>(sizeof(at::BFloat16));
  const int64_t steps = pairs * 2 / kTileK;
  const float* bias_high = bias == nullptr ? nullptr : bias + 16;
  for (int64_t m0 = 0; m0 < m_padded; m0 += 2 * kTileRows) {
    const bool second = m0 + kTileRows < m_padded;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const at::BFloat16* rows = a + m0 * lda;
    for (int64_t s = 0; s < steps; ++s) {
      const at::BFloat16* b = panel + s * (kTileK / 2) * kPairsBlock * 2;
      _tile_loadd(6, b, kPairRow);
      _tile_loadd(7, b + 32, kPairRow);
      _tile_loadd(4, rows + s * kTileK, a_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (second) {
        _tile_loadd(5, rows + kTileRows * lda + s * kTileK, a_stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    at::BFloat16* out = c + m0 * ldc;
    const int64_t first_rows = std::min(kTileRows, m - m0);
    _tile_stored(0, sums, 64);
    _tile_stored(1, sums + 256, 64);
    store_sums(sums, bias, out, ldc, first_rows, cols);
    store_sums(sums + 256, bias_high, out + 16, ldc, first_rows, cols - 16);
    const int64_t second_rows = std::clamp<int64_t>(m - m0 - kTileRows, 0, kTileRows);
    if (second_rows > 0) {
      _tile_stored(2, sums, 64);
      _tile_stored(3, sums + 256, 64);
      out += kTileRows * ldc;
      store_sums(sums, bias, out, ldc, second_rows, cols);
      store_sums(sums + 256, bias_high, out + 16, ldc, second_rows, cols - 16);
    }
  }
}

void amx_gemm(const at::BFloat16* a, int64_t lda, int64_t m, int64_t m_padded,
              const at::BFloat16* packed, int64_t blocks, int64_t pairs, const float* bias,
              at::BFloat16* c, int64_t n) {
  const int64_t panel_size = pairs * kPairsBlock * 2;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    __at_align__ float sums[2 * kTileRows * 16];
    load_tile_config();  // the tile state is each thread's own
    for (int64_t r0 = 0; r0 < m_padded; r0 += kChunkRows) {
      const int64_t rows = std::min(kChunkRows, m - r0);
      const int64_t rows_padded = std::min(kChunkRows, m_padded - r0);
      for (int64_t b = begin; b < end; ++b) {
        amx_panel(a + r0 * lda, lda, rows, rows_padded, packed + b * panel_size, pairs,
                  bias != nullptr ? bias + b * kPairsBlock : nullptr,
                  c + r0 * n + b * kPairsBlock, n, std::min(kPairsBlock, n - b * kPairsBlock),
                  sums);
      }
    }
    _tile_release();
  });
}

// Whether AMX takes these rows: enough of them, and k in whole tiles.
bool amx_takes(int64_t rows, int64_t pairs) {
  return rows >= kAmxMinRows && pairs % (kTileK / 2) == 0 && amx_permitted();
}

#endif  // DUOSERVE_AMX_TILES

#endif

// Whether this process multiplies pairs with AMX's tiles: built with them, and the
// kernel granted them.
bool amx_tiles_usable() {
#if DUOSERVE_AMX_TILES
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor bf16_pairs_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                             const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == kPairsBlock && packed.size(3) == 2,
              "packed must be pack_bf16_pairs' [blocks, in_features / 2, 32, 2]");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bfloat16 [rows, in]");
  const int64_t pairs = packed.size(1), n = out_features;
  TORCH_CHECK(x.size(1) == 2 * pairs, "x has ", x.size(1), " features, the weight takes ",
              2 * pairs);
  TORCH_CHECK(n >= 1 && n <= packed.size(0) * kPairsBlock &&
                  n > (packed.size(0) - 1) * kPairsBlock,
              "out_features does not match the packed weight");
  std::optional<at::Tensor> bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n && bias->scalar_type() == at::kBFloat16,
                "bias must be bfloat16 [out_features]");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor a = x.stride(1) == 1 ? x : x.contiguous();
  auto out = at::empty({x.size(0), n}, x.options());
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#if DUOSERVE_AMX_TILES
  if (amx_takes(x.size(0), pairs)) {
    // Rows past the last whole tile read zeros from a padded copy.
    const int64_t m = x.size(0);
    const int64_t m_padded = (m + kTileRows - 1) / kTileRows * kTileRows;
    at::Tensor rows = a;
    if (m_padded != m) {
      rows = at::empty({m_padded, a.size(1)}, a.options());
      rows.narrow(0, 0, m).copy_(a);
      rows.narrow(0, m, m_padded - m).zero_();
    }
    amx_gemm(rows.const_data_ptr<at::BFloat16>(), rows.stride(0), m, m_padded,
             packed.const_data_ptr<at::BFloat16>(), packed.size(0), pairs,
             bias32.has_value() ? bias32->const_data_ptr<float>() : nullptr,
             out.mutable_data_ptr<at::BFloat16>(), n);
    return out;
  }
#endif
  if (x.size(0) > 0) {
    pairs_gemm(a.const_data_ptr<at::BFloat16>(), a.stride(0), a.size(0),
               packed.const_data_ptr<at::BFloat16>(), packed.size(0), pairs,
               bias32.has_value() ? bias32->const_data_ptr<float>() : nullptr,
               out.mutable_data_ptr<at::BFloat16>(), n);
  }
  return out;
#else
  TORCH_CHECK(false, "bf16_pairs_linear: this build has no AVX512-BF16 dot products");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def("pack_bf16_pairs(Tensor weight) -> Tensor");
  m.def("bf16_pairs_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("amx_tiles_usable() -> bool", &amx_tiles_usable);
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) {
  m.impl("pack_bf16_pairs", &pack_bf16_pairs);
  m.impl("bf16_pairs_linear", &bf16_pairs_linear);
}

}  // namespace duoserve
