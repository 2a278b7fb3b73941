// What this build of the kernels was compiled for, so Python can size packed weights and
// choose fast paths: the vector level (vec.h), its float32 lanes, whether it has AVX512-BF16's
// dot products, and the widths of packed weight blocks in the register tile's order of
// preference (gemm_tile.h).

#include "vec.h"

#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "gemm_tile.h"

namespace duoserve {
namespace {

std::string cpu_capability() { return DUOSERVE_CAPABILITY; }

int64_t vector_lanes() { return kLanes; }

bool bf16_dot_products() { return kBf16DotProducts; }

// A tile of r rows by v vectors does r * v FMAs per r + v loads: the more FMAs per load,
// the nearer the tile runs to the FMA units' peak (AVX-512: 4 vectors, then 3, then 2;
// AVX2's 16 registers: 3, then 2, then 4, whose tile has only 2 rows).
std::vector<int64_t> packed_block_vectors() {
  const auto fmas_per_load = [](int64_t vectors) {
    const int64_t rows = vectors == 4 ? tile_rows<4>() : vectors == 3 ? tile_rows<3>()
                                                                      : tile_rows<2>();
    return static_cast<double>(rows * vectors) / static_cast<double>(rows + vectors);
  };
  std::vector<int64_t> widths{4, 3, 2};
  std::stable_sort(widths.begin(), widths.end(), [&](int64_t a, int64_t b) {
    return fmas_per_load(a) > fmas_per_load(b);
  });
  return widths;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def("cpu_capability() -> str", &cpu_capability);
  m.def("vector_lanes() -> int", &vector_lanes);
  m.def("bf16_dot_products() -> bool", &bf16_dot_products);
  m.def("packed_block_vectors() -> int[]", &packed_block_vectors);
}

}  // namespace duoserve
