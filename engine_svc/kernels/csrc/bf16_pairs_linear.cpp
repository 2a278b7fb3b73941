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
//
// An MLP's gate/up projection can be packed with 16 columns of gate and the same 16 of up in
// each panel (pack_bf16_gate_up_pairs): its kernels then store silu(gate) * up, the gate/up
// output never written nor read back (bf16_pairs_silu_mul), bit for bit what silu_and_mul
// makes of bf16_pairs_linear's output.

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
#include <vector>

#include "amx.h"
#include "stealing.h"

namespace duoserve {
namespace {

// Columns per panel: two vectors of 16.
constexpr int64_t kPairsBlock = 32;

// Where the panels' results go: panel b's 32 columns of a [rows, n] output; or, over the
// pairs of an MLP's gate and up packed 16 columns of each a panel (gate's first), silu(gate)
// * up's 16 columns of a [rows, n / 2] output, so the gate/up output is never written.
struct Output {
  at::BFloat16* c;
  int64_t n;  // the packed weight's columns
  bool silu_mul;

  int64_t ldc() const { return silu_mul ? n / 2 : n; }
  at::BFloat16* panel_row(int64_t row, int64_t b) const {
    return c + row * ldc() + b * (silu_mul ? kPairsBlock / 2 : kPairsBlock);
  }
  int64_t cols(int64_t b) const { return std::min(kPairsBlock, n - b * kPairsBlock); }
};

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

// The epilogue's helpers always inlined: GCC had left some as calls (vector arguments
// through memory, a vzeroupper before each), and one-row steps ran 1.15-1.2x slower.
#define DUOSERVE_INLINE __attribute__((always_inline)) inline

// The bfloat16 value store_rounded stores for a vector of sums, as float32.
DUOSERVE_INLINE fvec rounded(__m512 sum, bool has_bias, __m512 bias) {
  if (has_bias) sum = _mm512_add_ps(sum, bias);
  const __m512i wide = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(sum));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// 16 columns of silu(gate) * up from the sums of gate's and up's, each rounded to bfloat16
// first: what silu_and_mul makes of the stored gate/up output, bit for bit.
DUOSERVE_INLINE void store_silu_mul(__m512 gate, __m512 up, bool has_bias, __m512 gate_bias,
                           __m512 up_bias, at::BFloat16* c) {
  store_bf16(silu_times<at::BFloat16>(rounded(gate, has_bias, gate_bias),
                                      rounded(up, has_bias, up_bias)),
             c);
}

// The bias of a panel's `cols` columns as its two vectors (zeros without one).
struct PanelBias {
  const float* bias;
  __m512 low, high;

  DUOSERVE_INLINE PanelBias(const float* bias, int64_t cols)
      : bias(bias), low(bias_lanes(bias, column_mask(cols))),
        high(bias_lanes(bias == nullptr ? nullptr : bias + 16, column_mask(cols - 16))) {}
};

// The epilogue of a panel's row: its two vectors of sums (columns 0-15 and 16-31) plus the
// bias, rounded, as `out` takes them, into c (out.panel_row(row, panel)).
DUOSERVE_INLINE void store_panel_row(__m512 low, __m512 high, const PanelBias& bias,
                                     bool silu_mul, int64_t cols, at::BFloat16* c) {
  const bool has_bias = bias.bias != nullptr;
  if (silu_mul) {
    store_silu_mul(low, high, has_bias, bias.low, bias.high, c);
    return;
  }
  store_rounded(low, has_bias, bias.low, column_mask(cols), c);
  store_rounded(high, has_bias, bias.high, column_mask(cols - 16), c + 16);
}

// kSiluMul a template argument: the plain kernel's code stays the same with the silu
// epilogue beside it.
template <int kRows, bool kSiluMul>
void pairs_tile(const at::BFloat16* __restrict a, int64_t lda, const at::BFloat16* __restrict panel,
                int64_t pairs, const float* __restrict bias, at::BFloat16* __restrict c,
                int64_t ldc, int64_t cols, const char* next, int64_t prefetch) {
  static_assert(kVecs == 2, "the epilogue takes a panel as two vectors of columns");
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
  if constexpr (kSiluMul) {
    const PanelBias panel_bias(bias, cols);
    for (int r = 0; r < kRows; ++r) {
      store_silu_mul(acc[r][0], acc[r][1], bias != nullptr, panel_bias.low, panel_bias.high,
                     c + r * ldc);
    }
  } else {
    for (int v = 0; v < kVecs; ++v) {
      const __mmask16 mask = column_mask(cols - 16 * v);
      const __m512 add = bias_lanes(bias == nullptr ? nullptr : bias + 16 * v, mask);
      for (int r = 0; r < kRows; ++r) {
        store_rounded(acc[r][v], bias != nullptr, add, mask, c + r * ldc + 16 * v);
      }
    }
  }
}

template <bool kSiluMul, int kRows = kMaxRows>
void pairs_tile_rows(int64_t rows, const at::BFloat16* a, int64_t lda,
                     const at::BFloat16* panel, int64_t pairs, const float* bias,
                     at::BFloat16* c, int64_t ldc, int64_t cols, const char* next,
                     int64_t prefetch) {
  if constexpr (kRows > 1) {
    if (rows < kRows) {
      pairs_tile_rows<kSiluMul, kRows - 1>(rows, a, lda, panel, pairs, bias, c, ldc, cols,
                                           next, prefetch);
      return;
    }
  }
  pairs_tile<kRows, kSiluMul>(a, lda, panel, pairs, bias, c, ldc, cols, next, prefetch);
}

template <bool kSiluMul>
void pairs_gemm(const at::BFloat16* a, int64_t lda, int64_t m, const at::BFloat16* packed,
                int64_t blocks, int64_t pairs, const float* bias, const Output& out) {
  const int64_t panel_size = pairs * kPairsBlock * 2;
  const int64_t lines = panel_size * 2 / 64;
  const int64_t tiles = (m + kMaxRows - 1) / kMaxRows;
  const int64_t share = (lines + tiles - 1) / tiles;
  parallel_stealing(blocks, [&](StealingCursor& cursor) {
    for (int64_t b = cursor.next(); b >= 0; b = cursor.next()) {
      const at::BFloat16* panel = packed + b * panel_size;
      const char* next = cursor.continues_with(b + 1)
                             ? reinterpret_cast<const char*>(panel + panel_size)
                             : nullptr;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = t * kMaxRows;
        const int64_t prefetch =
            next == nullptr ? 0 : std::clamp<int64_t>(lines - t * share, 0, share);
        pairs_tile_rows<kSiluMul>(std::min<int64_t>(kMaxRows, m - m0), a + m0 * lda, lda,
                                  panel, pairs,
                                  bias != nullptr ? bias + b * kPairsBlock : nullptr,
                                  out.panel_row(m0, b), out.ldc(), out.cols(b),
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
// the dot-product kernel's. The first pass over a panel requests its steps kAmxLead ahead
// into L2 (below).
//
// On the 2-core Xeon with AMX, SmolLM2-135M's 120 decoder projections and LM head with the
// weights on huge pages, streaming from memory (ms for all 121, alternating in one process):
// 16 rows 12.7-13.6 against oneDNN's prepacked 18.8-21.2; 64 rows 17.5-23.8 against
// 24.2-25.1; 512 rows 92-95 against 106; 2,048 rows 426-454 against oneDNN's 334-348
// (prompt steps keep oneDNN's copy where it fits). Under 4 rows the dot products
// (memory-bound, no tile set-up) are the faster: 2 rows 11.6-12.1 against 13.4-13.6.

constexpr int64_t kAmxMinRows = 4;
// A step of k: the panel's 16 pair rows two B tiles read, 2 KiB.
constexpr int64_t kStepElements = kTileK * kPairsBlock;
constexpr int64_t kStepLines = kStepElements * 2 / 64;
// The first pass over a panel requests into L2 the step kAmxLead steps ahead (16 KiB, into
// the next panel near the end, the panels lying one after the other): the tile loads had
// waited on memory as long as the tiles computed. SmolLM2-135M's 120 decoder projections and
// LM head at 64 rows, weights streaming, processes alternating: 17.1-17.8 ms against
// 18.4-18.9 (the best of 21 calls, three pairs); 4 and 16 steps ahead measured no better.
// At 64 rows the 120 projections take 15-17 ms against 7.5-8.3 for one row (the bytes alone)
// and 6.9 for the 64 rows' tiles with the weights in cache: memory and tiles add up rather
// than overlap. Measured no faster (the Xeon with AMX, alternating in one session): the next
// panel requested over both 32-row passes; no request at all (the hardware's alone); into L1
// (prefetchnta: twice as slow); one pass of 4 row tiles per column half with the B tiles
// double-buffered; groups of 4-16 panels a pass at a time (the rows' A tiles kept in L1);
// 32- and 16-row chunks each a region of their own.
constexpr int64_t kAmxLead = 8;
// Rows a thread takes through all of its panels before the next rows: a prompt step's
// activations stay in L2 while the thread's panels pass by (2,048 rows in one chunk re-read
// them from L3 for every panel: the 121 projections 477-515 ms against 426-454 in chunks
// of 256 or 512).
constexpr int64_t kChunkRows = 256;

// The tiles (amx.h): 0-3 sums (two row tiles by two column halves), 4-5 rows of A, 6-7 the
// panel's column halves.

// Two C tiles' sums (a panel's columns 0-15 in `sums`, 16-31 at sums + 256, 16 x 16
// float32 each) through the epilogue into c's first `rows` rows.
void store_sums(const float* __restrict sums, const float* __restrict bias,
                at::BFloat16* __restrict c, int64_t ldc, int64_t rows, int64_t cols,
                bool silu_mul) {
  const PanelBias panel_bias(bias, cols);
  for (int64_t r = 0; r < rows; ++r) {
    store_panel_row(_mm512_loadu_ps(sums + r * 16), _mm512_loadu_ps(sums + 256 + r * 16),
                    panel_bias, silu_mul, cols, c + r * ldc);
  }
}

// Panel b for rows [0, m) of a, whose rows up to m_padded (a multiple of 16) can be read,
// into out's rows from row0.
void amx_panel(const at::BFloat16* a, int64_t lda, int64_t m, int64_t m_padded,
               const at::BFloat16* panel, int64_t pairs, const float* bias, const Output& out,
               int64_t row0, int64_t b, float* sums) {
  constexpr int64_t kPairRow = kPairsBlock * 2 * sizeof(at::BFloat16);
  const int64_t a_stride = lda * static_cast<int64_t>(sizeof(at::BFloat16));
  const int64_t steps = pairs * 2 / kTileK;
  const int64_t ldc = out.ldc(), cols = out.cols(b);
  for (int64_t m0 = 0; m0 < m_padded; m0 += 2 * kTileRows) {
    const bool second = m0 + kTileRows < m_padded;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const at::BFloat16* rows = a + m0 * lda;
    for (int64_t s = 0; s < steps; ++s) {
      const at::BFloat16* step = panel + s * kStepElements;
      if (m0 == 0) {  // the first pass over the panel requests what is kAmxLead ahead
        const char* ahead = reinterpret_cast<const char*>(step + kAmxLead * kStepElements);
        for (int64_t line = 0; line < kStepLines; ++line) prefetch_l2(ahead + 64 * line);
      }
      _tile_loadd(6, step, kPairRow);
      _tile_loadd(7, step + 32, kPairRow);
      _tile_loadd(4, rows + s * kTileK, a_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (second) {
        _tile_loadd(5, rows + kTileRows * lda + s * kTileK, a_stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, sums, 64);
    _tile_stored(1, sums + 256, 64);
    store_sums(sums, bias, out.panel_row(row0 + m0, b), ldc, std::min(kTileRows, m - m0), cols,
               out.silu_mul);
    const int64_t second_rows = std::clamp<int64_t>(m - m0 - kTileRows, 0, kTileRows);
    if (second_rows > 0) {
      _tile_stored(2, sums, 64);
      _tile_stored(3, sums + 256, 64);
      store_sums(sums, bias, out.panel_row(row0 + m0 + kTileRows, b), ldc, second_rows, cols,
                 out.silu_mul);
    }
  }
}

void amx_gemm(const at::BFloat16* a, int64_t lda, int64_t m, int64_t m_padded,
              const at::BFloat16* packed, int64_t blocks, int64_t pairs, const float* bias,
              const Output& out) {
  const int64_t panel_size = pairs * kPairsBlock * 2;
  // A region for each chunk of rows, its panels split between the threads the same way each
  // time, so a thread's panels pass by the chunk in its L2.
  for (int64_t r0 = 0; r0 < m_padded; r0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, m - r0);
    const int64_t rows_padded = std::min(kChunkRows, m_padded - r0);
    parallel_stealing(blocks, [&](StealingCursor& cursor) {
      __at_align__ float sums[2 * kTileRows * 16];
      load_tile_config();  // the tile state is each thread's own
      for (int64_t b = cursor.next(); b >= 0; b = cursor.next()) {
        amx_panel(a + r0 * lda, lda, rows, rows_padded, packed + b * panel_size, pairs,
                  bias != nullptr ? bias + b * kPairsBlock : nullptr, out, r0, b, sums);
      }
      _tile_release();
    });
  }
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

// [gate; up] rows of an MLP's fused projection, [2 * width, in], interleaved 16 at a time
// (gate's rows 0-15, up's 0-15, gate's 16-31, ...): packed in pairs, each panel holds 16
// columns of gate and the same 16 of up, for the silu(gate) * up epilogue.
at::Tensor gate_up_interleaved(const at::Tensor& rows) {
  const int64_t width = rows.size(0) / 2;
  TORCH_CHECK(rows.size(0) % 2 == 0 && width % 16 == 0,
              "gate/up: the halves must be a multiple of 16 rows, got ", rows.size(0));
  std::vector<int64_t> interleaved{width / 16, 2, 16};
  std::vector<int64_t> halves{2, width / 16, 16};
  const at::IntArrayRef tail = rows.sizes().slice(1);
  halves.insert(halves.end(), tail.begin(), tail.end());
  interleaved.insert(interleaved.end(), tail.begin(), tail.end());
  std::vector<int64_t> order{1, 0, 2};
  for (int64_t d = 1; d < rows.dim(); ++d) order.push_back(d + 2);
  return rows.reshape(halves).permute(order).reshape(rows.sizes());
}

at::Tensor pack_bf16_gate_up_pairs(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [2 * width, in_features]");
  return pack_bf16_pairs(gate_up_interleaved(weight));
}

// x through the packed weight into `out_features` columns, or into silu(gate) * up's
// out_features / 2 where the weight is pack_bf16_gate_up_pairs'.
at::Tensor pairs_forward(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias, bool silu_mul) {
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
  TORCH_CHECK(!silu_mul || n % kPairsBlock == 0,
              "gate/up pairs: out_features must be a multiple of 32, got ", n);
  std::optional<at::Tensor> bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n && bias->scalar_type() == at::kBFloat16,
                "bias must be bfloat16 [out_features]");
    bias32 = (silu_mul ? gate_up_interleaved(*bias) : *bias).to(at::kFloat).contiguous();
  }
  const at::Tensor a = x.stride(1) == 1 ? x : x.contiguous();
  auto out = at::empty({x.size(0), silu_mul ? n / 2 : n}, x.options());
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  const Output to{out.mutable_data_ptr<at::BFloat16>(), n, silu_mul};
  const float* bias_data = bias32.has_value() ? bias32->const_data_ptr<float>() : nullptr;
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
             packed.const_data_ptr<at::BFloat16>(), packed.size(0), pairs, bias_data, to);
    return out;
  }
#endif
  if (x.size(0) > 0) {
    (silu_mul ? pairs_gemm<true> : pairs_gemm<false>)(
        a.const_data_ptr<at::BFloat16>(), a.stride(0), a.size(0),
        packed.const_data_ptr<at::BFloat16>(), packed.size(0), pairs, bias_data, to);
  }
  return out;
#else
  TORCH_CHECK(false, "bf16_pairs_linear: this build has no AVX512-BF16 dot products");
#endif
}

at::Tensor bf16_pairs_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                             const std::optional<at::Tensor>& bias) {
  return pairs_forward(x, packed, out_features, bias, false);
}

// silu(gate) * up of an MLP's [gate; up] projection (out_features = 2 * width) packed by
// pack_bf16_gate_up_pairs, [rows, width]: silu_and_mul(bf16_pairs_linear(...)) of the
// plainly packed weight, bit for bit, without writing the gate/up output.
at::Tensor bf16_pairs_silu_mul(const at::Tensor& x, const at::Tensor& packed,
                               int64_t out_features, const std::optional<at::Tensor>& bias) {
  return pairs_forward(x, packed, out_features, bias, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def("pack_bf16_pairs(Tensor weight) -> Tensor");
  m.def("pack_bf16_gate_up_pairs(Tensor weight) -> Tensor");
  m.def("bf16_pairs_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def(
      "bf16_pairs_silu_mul(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("amx_tiles_usable() -> bool", &amx_tiles_usable);
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) {
  m.impl("pack_bf16_pairs", &pack_bf16_pairs);
  m.impl("pack_bf16_gate_up_pairs", &pack_bf16_gate_up_pairs);
  m.impl("bf16_pairs_linear", &bf16_pairs_linear);
  m.impl("bf16_pairs_silu_mul", &bf16_pairs_silu_mul);
}

}  // namespace duoserve
