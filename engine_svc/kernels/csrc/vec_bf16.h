// bfloat16 in and out of the float32 lanes of vec.h: exact widening loads (one value a lane,
// or a pair a lane), rounding to nearest even as torch rounds, stores of rounded lanes, and a
// row's largest value in either dtype. Part of vec.h.
#pragma once

#ifndef DUOSERVE_VEC_H
#error "include vec.h, which brings this header with it"
#endif

namespace duoserve {

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

}  // namespace duoserve
