// A sequence's rows in the paged KV cache, for decode attention (paged_attention.cpp): found
// through its block table once, then loaded into cache before the passes or read in order
// with the rows ahead requested, since the hardware prefetchers do not follow the table.
#pragma once

#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include <unistd.h>

namespace duoserve {

// Where a sequence's cached tokens start in the caches, in elements from the cache's first
// row (the K and V caches share the layout): token first + i's row at offsets[i], for
// tokens [first, context_len). Found once a sequence, through its block table, for every
// pass over K and V of all its KV heads: stepping a cursor through the table in each pass
// cost about as much as the pass's dot products.
struct TokenRows {
  const int64_t* offsets;
  int64_t count;
};

inline TokenRows locate_rows(const int32_t* table, int64_t first, int64_t context_len,
                             int64_t block_size, int64_t row, std::vector<int64_t>& offsets) {
  const int64_t count = std::max<int64_t>(context_len - first, 0);
  offsets.resize(count);
  int64_t i = 0;
  for (int64_t block = first / block_size; i < count; ++block) {
    const int64_t base = static_cast<int64_t>(table[block]) * block_size;
    for (int64_t slot = (first + i) % block_size; slot < block_size && i < count; ++slot) {
      offsets[i++] = (base + slot) * row;
    }
  }
  return {offsets.data(), count};
}

// Each step of a first pass over a cache prefetches the row kLeadTokens ahead: the hardware
// prefetchers do not follow the block table. Before, entering a block prefetched all of the
// next block's rows at once, and perf still showed the loads of K and V rows stalling for
// most of the kernel's time; one row a step ran 1.4x faster at 64 sequences and 1.6x at one
// (the Xeon with AMX, bfloat16). 40 tokens ahead: on the Zen 5, 64 bfloat16 sequences of
// 130-300 tokens (30 layers of SmolLM2's heads) took 8.0-8.4 ms against 16 tokens' 11.1-11.2
// (300: 16.4 vs 23.0); float32, and one sequence, unchanged. On the Xeon, 8 (into L2) to 32
// measured alike. Later passes over the same rows (other query heads) find them in L2.
// Into L2, not L1 (prefetcht1, not prefetcht0): a core has few L1 misses in flight and the
// prefetched rows held them. On a Zen 4 VM (AMD EPYC family 25 model 17), the same 30 layers
// of 64 sequences (blocks in random order) took 17.8 ms against 27.6-28.5 into L1 (bfloat16;
// float32 32-33 against 45-47; the x86-64-v3 build 23.7 against 34.3; one thread 34-35
// against 54-55), and a bfloat16 batch's decode forward 55-56 ms a step against 61. Leads of
// 20, 80 and 160 tokens were slower into L2 than 40.
// Also measured no faster on the Xeon with AMX (64 sequences of 132-310 tokens, 30 layers,
// 21-23 ms from memory against 13-14 with one layer's rows in cache): a task's first 40 rows
// of K and V, every KV head's, requested when it starts, and with them the next task's
// (claimed a task ahead); the scores on AMX's tiles (a block's 16 key rows an A tile as they
// lie, the query heads a B tile: 1 ms faster for 30 layers in cache, none from memory).
// On another Zen 4 VM (same family and model; its float32 30 layers 46-60 ms, one thread
// 101 ms against two threads' 52: bound per core, not by the memory), alternating in one
// process: no prefetch at all measured alike (61.3 against 59.9 ms best); the first KV head's
// pass requesting every head's lines of the row, and the K pass requesting V's rows too, no
// faster; one pass over whole rows for every KV head (scores and V sums chunk by chunk, the
// same bits) 3-5% faster with 4 to 64 rows ahead, not worth a second copy of the kernel.
// There too (64 sequences, 30 layers), blocks in random order: 32, 64 and 128 tokens a block
// took bfloat16 35.9, 31.0 and 26.8 ms against 16's 33.5, float32 49.7, 48.8 and 68.4
// against 51.9; 16-token blocks in order took bfloat16 21.7-22.0 ms (float32 39.4-40.1), and
// the engine's own order (each prompt's blocks together, decode blocks taken as sequences
// cross block ends) came within 10% of in order. Leads of 10-80 tokens alike within the VM's
// noise; the caches on transparent huge pages (in the engine's order) 0.93-1.11x.
constexpr int64_t kLeadTokens = 40;

// A task of whole sequences (every KV head) on the vector path loads its K and V rows before its
// passes, token by token, a byte every 64 (a cache line's), when they take at most kLoadedRowsPerL2
// times the L2 the C library reports: then the passes read them from cache, without prefetching. A
// pass over one KV head reads a third of each row (SmolLM2), a stride the hardware prefetchers
// follow poorly, and the software prefetches (kLeadTokens) hold the core's few L1 miss buffers;
// loads over whole rows, in order, are a stream the prefetchers run ahead of. On the Zen 4 VM (AMD
// EPYC family 25 model 17, 1 MB of L2 a core; 64 sequences, SmolLM2's heads, 30 layers, blocks in
// order, caches evicted between layers, alternating in one process): float32 at 192 tokens 29.6
// against 42.1 ms (30.3 loading K's rows then V's; 36.4 requesting the rows with prefetches instead
// of loading them), 400 tokens 63.5 against 81.4, 800 (32 sequences) 94.6 against 115.5, 1,300 (16
// sequences, 2 MB of rows each: the limit there) 52.1 against 58.8; bfloat16 at 192 tokens 15.8
// against 21.3; the x86-64-v3 build 30.6 against 36.9 (float32) and 21.8 against 30.1 (bfloat16). A
// float32 batch of 64 greedy requests (128 prompt tokens, 128 new) through the engine: 139.2
// against 152.5 ms an output token, the same tokens. Tasks of one KV head (a few sequences) keep
// the prefetches: loading their part of the rows first measured alike. Also tried (float32, 64
// sequences of 192 tokens, another run, where loading first took 26.9 ms): claiming the next task
// ahead and requesting a third of its rows after each KV head's passes, into L2 31.2 ms and into L1
// 34.7, slower; loading that third instead, 25.8, within the run's spread (25.1-27.1 against
// 26.4-27.3) and not kept.
constexpr int64_t kLoadedRowsPerL2 = 2;

// The L2 in bytes as the C library reports it (a core's, or a cluster's where cores share one;
// 512 KiB where it reports none).
inline int64_t l2_cache_bytes() {
#ifdef _SC_LEVEL2_CACHE_SIZE
  static const int64_t bytes = [] {
    const long reported = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return reported > 0 ? static_cast<int64_t>(reported) : int64_t{512} << 10;
  }();
  return bytes;
#else
  return int64_t{512} << 10;
#endif
}

// Loads a byte every 64 (a cache line's) of the task's K and V rows (`row` elements each), K's
// and V's row of a token together, in token order, so the rows are in cache for the passes.
template <typename scalar_t>
void load_rows(const scalar_t* k_cache, const scalar_t* v_cache, const TokenRows& rows,
               int64_t row) {
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(scalar_t));
  unsigned sum = 0;
  for (int64_t i = 0; i < rows.count; ++i) {
    const auto* k_row = reinterpret_cast<const unsigned char*>(k_cache + rows.offsets[i]);
    const auto* v_row = reinterpret_cast<const unsigned char*>(v_cache + rows.offsets[i]);
    for (int64_t line = 0; line < row_bytes; line += 64) sum += k_row[line] + v_row[line];
  }
  __asm__ __volatile__("" : : "r"(sum));  // the loads are the point: keep them
}

// The rows of a task's tokens in order, `span` elements each (kSpan when known at compile
// time, so the prefetches unroll), from `cache` (offset to the task's KV head).
template <typename scalar_t, int64_t kSpan = 0>
class RowReader {
 public:
  RowReader(const scalar_t* cache, const TokenRows& rows, bool prefetch, int64_t span = kSpan)
      : cache_(cache), offsets_(rows.offsets), count_(rows.count), lines_(lines_of(span)),
        prefetch_(prefetch) {
    if (!prefetch_) return;
    for (int64_t i = 0; i < std::min(kLeadTokens, count_); ++i) prefetch_row(i);
  }

  __attribute__((always_inline)) const scalar_t* next() {
    if (prefetch_ && next_ + kLeadTokens < count_) prefetch_row(next_ + kLeadTokens);
    return cache_ + offsets_[next_++];
  }

 private:
  static constexpr int64_t lines_of(int64_t span) {
    return (span * static_cast<int64_t>(sizeof(scalar_t)) + 63) / 64;
  }

  __attribute__((always_inline)) void prefetch_row(int64_t i) const {
    const char* row = reinterpret_cast<const char*>(cache_ + offsets_[i]);
    if constexpr (kSpan > 0) {
      for (int64_t line = 0; line < lines_of(kSpan); ++line) prefetch_l2(row + 64 * line);
    } else {
      for (int64_t line = 0; line < lines_; ++line) prefetch_l2(row + 64 * line);
    }
  }

  const scalar_t* cache_;
  const int64_t* offsets_;
  int64_t count_;
  int64_t lines_;
  bool prefetch_;
  int64_t next_ = 0;
};

// Calls visit(i, token i's row) for the task's tokens, in order.
template <typename scalar_t, int64_t kSpan = 0, typename Visit>
__attribute__((always_inline)) inline void for_each_row(const scalar_t* cache,
                                                        const TokenRows& rows, bool prefetch,
                                                        int64_t span, Visit&& visit) {
  RowReader<scalar_t, kSpan> reader(cache, rows, prefetch, span);
  for (int64_t i = 0; i < rows.count; ++i) visit(i, reader.next());
}

}  // namespace duoserve
