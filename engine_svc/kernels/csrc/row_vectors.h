// A row of activations a vector at a time, for the fused elementwise ops (rms_norm.cpp,
// rotary.cpp, silu_and_mul.cpp): float32 or bfloat16 loaded into float32 lanes, the last
// vector of a row partial.
#pragma once

#include "vec.h"

#include <algorithm>
#include <cstdint>

namespace duoserve {

// A row's vectors: body(i, n) for the kLanes values from i, n of them in the row (fewer in
// the last vector: loads give zeros past them, stores keep to them).
template <typename Body>
inline void each_vector(int64_t width, Body&& body) {
  for (int64_t i = 0; i < width; i += kLanes) body(i, std::min<int64_t>(kLanes, width - i));
}
inline fvec load(const at::BFloat16* p, int64_t n) {
  return n == kLanes ? fvec(load_bf16(p)) : load_bf16(p, n);
}
inline fvec load(const float* p, int64_t n) { return fvec::loadu(p, n); }
inline void store(fvec v, float* p, int64_t n) { v.store(p, n); }
inline void store(fvec rounded, at::BFloat16* p, int64_t n) {
  if (n == kLanes) {
    store_bf16(rounded, p);
  } else {
    store_bf16(rounded, p, n);
  }
}

}  // namespace duoserve
