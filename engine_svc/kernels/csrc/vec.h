// The vector type every kernel is written in: ATen's Vectorized<float>, compiled for the
// level this library is built for (-march). One source gives AVX-512 (16 lanes, 32
// registers), AVX2 (8 lanes, 16 registers), NEON (4 lanes, 32 registers) and plain C++.
// Include this header before any other, in every source: it picks ATen's vector headers.
#pragma once

// ATen's own kernels get these from their build; an extension sets them itself. The inline
// namespaces are named for this library, so none of our inline functions can be resolved
// to libtorch's copies of them (or the reverse).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512 1
#define CPU_CAPABILITY duoserve_avx512
#define DUOSERVE_CAPABILITY "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2 1
#define CPU_CAPABILITY duoserve_avx2
#define DUOSERVE_CAPABILITY "avx2"
#elif defined(__aarch64__)
#define CPU_CAPABILITY duoserve_neon
#define DUOSERVE_CAPABILITY "neon"
#else
#define CPU_CAPABILITY duoserve_default
#define DUOSERVE_CAPABILITY "default"
#endif

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace duoserve {

using fvec = at::vec::Vectorized<float>;

constexpr int kLanes = fvec::size();

// The level's own register type, convertible to and from fvec. Arrays of accumulators are
// declared of this type: GCC keeps arrays of a plain vector type in registers, but spilled
// arrays of fvec (a class) to the stack, halving the register tile's speed.
#if defined(CPU_CAPABILITY_AVX512)
using vreg = __m512;
#elif defined(CPU_CAPABILITY_AVX2)
using vreg = __m256;
#elif defined(__aarch64__)
using vreg = float32x4_t;
#else
using vreg = fvec;
#endif

inline vreg fmadd(vreg a, vreg b, vreg c) { return at::vec::fmadd(fvec(a), fvec(b), fvec(c)); }

// AVX512-BF16's dot products of bfloat16 pairs (vdpbf16ps: Intel from Cooper Lake and
// Sapphire Rapids, AMD Zen 4), where the build's -march has them.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool kBf16DotProducts = true;
#else
constexpr bool kBf16DotProducts = false;
#endif

// AMX's bfloat16 tiles (Intel from Sapphire Rapids), where the build's -march has them beside
// AVX512-BF16 (bf16_pairs_amx.h multiplies its panels with them; Linux only, which
// hands a process the tile registers on request).
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__) && defined(__linux__)
#define DUOSERVE_AMX_TILES 1
#else
#define DUOSERVE_AMX_TILES 0
#endif

// Vector registers of the level: the register-tile kernels size their accumulators to fit.
#if defined(CPU_CAPABILITY_AVX512) || defined(__aarch64__)
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif

// Accumulators a register tile keeps: three quarters of the registers, leaving the rest
// for the panel's vectors and the broadcast value (24 of 32, 12 of 16).
constexpr int kTileAccumulators = kVectorRegisters * 3 / 4;

// The widest panel the register tile takes: 4 vectors of columns.
constexpr int kPanelVectors = 4;

// Sum and maximum of the lanes (ATen's NEON vector lacks these members, and its generic
// vector's do not compile).
inline float reduce_add(fvec v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return v.reduce_add();
#elif defined(__aarch64__)
  return vaddvq_f32(v);
#else
  __at_align__ float lanes[kLanes];
  v.store(lanes);
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  return sum;
#endif
}

inline float reduce_max(fvec v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return v.reduce_max();
#elif defined(__aarch64__)
  return vmaxvq_f32(v);
#else
  __at_align__ float lanes[kLanes];
  v.store(lanes);
  float best = lanes[0];
  for (float lane : lanes) best = lane > best ? lane : best;
  return best;
#endif
}

inline void prefetch_l2(const void* address) { __builtin_prefetch(address, 0, 2); }

// kLanes bfloat16 values as float32: exact, a bfloat16 being the top half of a float32's
// bits (a zero-extend and a shift; ATen's generic conversion ran at ~1 value per cycle).
inline vreg load_bf16(const at::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
#elif defined(__aarch64__)
  const uint16x4_t half = vld1_u16(reinterpret_cast<const uint16_t*>(p));
  return vreinterpretq_f32_u32(vshll_n_u16(half, 16));
#else
  __at_align__ float lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = static_cast<float>(p[i]);
  return fvec::loadu(lanes);
#endif
}

// kLanes pairs of bfloat16 (2 * kLanes values, lane i's two side by side) as float32: the
// first of each pair in `first`, the second in `second`. Exact: a pair is one 32-bit lane,
// the first value its low half (shifted up, it is that value's float32) and the second its
// high half (the low half cleared). One load and two single-µop operations for 2 * kLanes
// values, where load_bf16 takes a widening load and a shift for each kLanes.
inline void load_bf16_pairs(const at::BFloat16* p, vreg& first, vreg& second) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i pairs = _mm512_loadu_si512(p);
  first = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
  second = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(~0xffff)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  first = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  second = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(~0xffff)));
#elif defined(__aarch64__)
  const uint32x4_t pairs = vreinterpretq_u32_u16(vld1q_u16(reinterpret_cast<const uint16_t*>(p)));
  first = vreinterpretq_f32_u32(vshlq_n_u32(pairs, 16));
  second = vreinterpretq_f32_u32(vandq_u32(pairs, vdupq_n_u32(0xffff0000u)));
#else
  __at_align__ float lanes[2][kLanes];
  for (int i = 0; i < kLanes; ++i) {
    lanes[0][i] = static_cast<float>(p[2 * i]);
    lanes[1][i] = static_cast<float>(p[2 * i + 1]);
  }
  first = fvec::loadu(lanes[0]);
  second = fvec::loadu(lanes[1]);
#endif
}

// n bfloat16 values as float32.
inline void widen_bf16(const at::BFloat16* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) fvec(load_bf16(src + i)).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// v with each lane rounded to the nearest bfloat16 (ties to even), still as float32: the
// bits plus 0x7fff plus the kept part's lowest bit, the low half cleared (finite values).
inline fvec round_to_bf16(fvec v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(sum, _mm512_set1_epi32(~0xffff)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i sum = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(sum, _mm256_set1_epi32(~0xffff)));
#elif defined(__aarch64__)
  const uint32x4_t bits = vreinterpretq_u32_f32(vreg(v));
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
  const uint32x4_t sum = vaddq_u32(bits, vaddq_u32(odd, vdupq_n_u32(0x7fff)));
  return fvec(vreinterpretq_f32_u32(vandq_u32(sum, vdupq_n_u32(0xffff0000u))));
#else
  __at_align__ float lanes[kLanes];
  v.store(lanes);
  for (float& lane : lanes) lane = static_cast<float>(static_cast<at::BFloat16>(lane));
  return fvec::loadu(lanes);
#endif
}

// kLanes float32 lanes, each rounded already by round_to_bf16, stored as bfloat16: the high
// half of each lane's bits, with no rounding left to do (ATen's conversion rounds again and
// checks for NaN, and on AVX2 packs across the halves of the register).
inline void store_bf16(fvec rounded, at::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(rounded), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high),
                                          _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
#elif defined(__aarch64__)
  const uint16x4_t high = vshrn_n_u32(vreinterpretq_u32_f32(vreg(rounded)), 16);
  vst1_u16(reinterpret_cast<uint16_t*>(p), high);
#else
  __at_align__ float lanes[kLanes];
  rounded.store(lanes);
  for (int i = 0; i < kLanes; ++i) p[i] = static_cast<at::BFloat16>(lanes[i]);
#endif
}

// The first n (< kLanes) bfloat16 values as float32, zeros after; and the first n lanes of
// a rounded vector stored as bfloat16: a row's last, partial vector.
inline fvec load_bf16(const at::BFloat16* p, int64_t n) {
  __at_align__ at::BFloat16 lanes[kLanes] = {};
  std::memcpy(lanes, p, n * sizeof(at::BFloat16));
  return load_bf16(lanes);
}

inline void store_bf16(fvec rounded, at::BFloat16* p, int64_t n) {
  __at_align__ at::BFloat16 lanes[kLanes];
  store_bf16(rounded, lanes);
  std::memcpy(p, lanes, n * sizeof(at::BFloat16));
}

// A vector of a row of logits, float32 or bfloat16, as float32; a row's largest value (its
// last, partial vector one value at a time).
inline fvec load_lanes(const float* p) { return fvec::loadu(p); }
inline fvec load_lanes(const at::BFloat16* p) { return fvec(load_bf16(p)); }

template <typename T>
float row_max(const T* row, int64_t n) {
  fvec best(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) best = at::vec::maximum(best, load_lanes(row + i));
  float result = reduce_max(best);
  for (; i < n; ++i) result = std::max(result, static_cast<float>(row[i]));
  return result;
}

// silu(g) = g / (1 + exp(-g)) as torch's CPU kernel computes it, with ATen's vectorized exp
// (Sleef's on AVX-512 and AVX2): torch's bits, and at 2,048 rows of SmolLM2's MLP 1.44x the
// speed of the same formula on a degree-7 polynomial exp (bfloat16 on the Xeon with AMX).
// bfloat16 gates look it up instead (silu_bf16_table below).
inline fvec silu(fvec g) { return g / (fvec(1.0f) + g.neg().exp()); }

// silu of every bfloat16 value rounded to bfloat16, by the value's bits: a bfloat16 gate has
// 65,536 values, so its rounded silu is a lookup (a gather from 128 KiB, in L2) rather than
// an exp and a division, whose chain of dependent steps the gate/up pairs' epilogue could
// not hide. The entries are silu() above, so the lookup's bits are the computation's. On the
// Xeon with AMX (SmolLM2's MLP, bfloat16, weights in cache): the gate/up pairs storing
// silu(gate) * up at 64 rows 207 -> 124 us (116-125 storing the plain gate/up output);
// silu_and_mul of [2048, 2 x 1536] 1210 -> 587 us, of 64 rows 33.9 -> 18.6. One entry more,
// so a 32-bit gather at the last index reads inside the table.
inline const uint16_t* silu_bf16_table() {
  static const std::vector<uint16_t> table = [] {
    constexpr int64_t kValues = 1 << 16;
    std::vector<uint16_t> entries(kValues + 1, 0);
    __at_align__ float lanes[kLanes];
    for (int64_t first = 0; first < kValues; first += kLanes) {
      for (int i = 0; i < kLanes; ++i) {
        const uint32_t bits = static_cast<uint32_t>(first + i) << 16;
        std::memcpy(&lanes[i], &bits, sizeof(bits));
      }
      round_to_bf16(silu(fvec::loadu(lanes))).store(lanes);
      for (int i = 0; i < kLanes; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &lanes[i], sizeof(bits));
        entries[first + i] = static_cast<uint16_t>(bits >> 16);
      }
    }
    return entries;
  }();
  return table.data();
}

// round_to_bf16(silu(gate)) for lanes holding bfloat16 values (their low 16 bits zero).
inline fvec silu_bf16(fvec gate) {
  const uint16_t* table = silu_bf16_table();
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i index = _mm512_srli_epi32(_mm512_castps_si512(gate), 16);
  const __m512i entry = _mm512_i32gather_epi32(index, table, 2);
  return _mm512_castsi512_ps(_mm512_slli_epi32(entry, 16));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i index = _mm256_srli_epi32(_mm256_castps_si256(gate), 16);
  const __m256i entry = _mm256_i32gather_epi32(reinterpret_cast<const int*>(table), index, 2);
  return _mm256_castsi256_ps(_mm256_slli_epi32(entry, 16));
#else
  __at_align__ float lanes[kLanes];
  gate.store(lanes);
  for (float& lane : lanes) {
    uint32_t bits;
    std::memcpy(&bits, &lane, sizeof(bits));
    bits = static_cast<uint32_t>(table[bits >> 16]) << 16;
    std::memcpy(&lane, &bits, sizeof(bits));
  }
  return fvec::loadu(lanes);
#endif
}

// silu(gate) * up where gate and up are values of T: rounded where torch's silu, then its
// mul, round their results (silu_and_mul, and the gate/up pairs' epilogue).
template <typename T>
inline fvec silu_times(fvec gate, fvec up) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return round_to_bf16(silu_bf16(gate) * up);
  } else {
    return silu(gate) * up;
  }
}

// Lane i of the result is the sum of the lanes of v[i], for kLanes vectors: a transpose-
// and-add tree where the level has one, in place of kLanes horizontal sums.
inline fvec transpose_sum(const vreg* v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 pairs[8], quads[4], halves[2];
  for (int j = 0; j < 8; ++j) {
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                             _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  }
  for (int j = 0; j < 4; ++j) {
    quads[j] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], 0xEE));
  }
  for (int j = 0; j < 2; ++j) {
    halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
#elif defined(CPU_CAPABILITY_AVX2)
  // hadd sums neighbours within each 128-bit half: two rounds leave, per half, the four
  // vectors' partial sums; adding the halves finishes them.
  const __m256 low4 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high4 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low4, high4, 0x20),
                       _mm256_permute2f128_ps(low4, high4, 0x31));
#elif defined(__aarch64__)
  return vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3]));
#else
  __at_align__ float sums[kLanes];
  for (int i = 0; i < kLanes; ++i) sums[i] = reduce_add(v[i]);
  return fvec::loadu(sums);
#endif
}

}  // namespace duoserve
