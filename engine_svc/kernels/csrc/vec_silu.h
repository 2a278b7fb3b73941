// silu and silu(gate) * up on the float32 lanes of vec.h, with torch's bits: float32 through
// ATen's vectorized exp, bfloat16 through a table of every rounded value. Part of vec.h.
#pragma once

#ifndef DUOSERVE_VEC_H
#error "include vec.h, which brings this header with it"
#endif

namespace duoserve {

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

}  // namespace duoserve
