// AMX's tile registers, for the kernels that multiply bfloat16 with them (bf16_pairs_amx.h,
// prefill_attention_amx.h): Linux's permission and the one tile shape they all use. Include
// after vec.h, which defines DUOSERVE_AMX_TILES.
#pragma once

#if DUOSERVE_AMX_TILES

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace duoserve {

// Rows of a tile; every tile is 16 rows of 64 bytes (16 float32 sums, or 32 bfloat16 values:
// 16 pairs of k).
constexpr int64_t kTileRows = 16;
constexpr int64_t kTileK = 32;

// Linux gives a process AMX's register state only when it asks for it (once, for every
// thread); where it refuses, the kernels without tiles serve.
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// Tiles 0-7 shaped 16 x 64 bytes (palette 1), for the calling thread: the tile state is
// each thread's own. _tile_release() when done.
inline void load_tile_config() {
  struct alignas(64) TileConfig {
    uint8_t palette_id = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = 64;
  }
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes of the 64: without this
  // barrier, inlined, the stores of the shapes could be dropped (a standalone test loaded
  // a configuration of zeros and faulted).
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

}  // namespace duoserve

#endif  // DUOSERVE_AMX_TILES
