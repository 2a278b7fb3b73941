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

// The rest of the vector vocabulary, which every source gets with this header: bfloat16 in
// and out of float32 lanes (vec_bf16.h), and silu (vec_silu.h). They are parts of this
// header, included from here only.
#define DUOSERVE_VEC_H
#include "vec_bf16.h"
#include "vec_silu.h"
