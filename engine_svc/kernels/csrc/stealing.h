// Items [0, n) over torch's threads as a static split would hand them out (thread t a
// contiguous range, taken in order, so a kernel can fetch its next item ahead), except that
// a thread that finishes its own range takes items from the back of another's.
//
// A static split makes every parallel region as slow as its slowest thread. On a machine
// whose cores other processes share (the engine service, the frontend and its clients beside
// the model's threads), a thread that loses its core for a while held up the whole region.
// Here the other thread takes over the preempted one's remaining items: with a neighbour
// taking 0.2 of a core in 100 us bursts, a bfloat16 decode step of SmolLM2-135M at 64 rows
// grew 16-19% (25-28% with the static split) on the 2-core AMX Xeon.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace duoserve {

class StealingRanges {
 public:
  StealingRanges(int64_t n, int64_t threads)
      : threads_(std::max<int64_t>(1, threads)), ranges_(new Range[threads_]) {
    const int64_t share = (n + threads_ - 1) / threads_;
    for (int64_t t = 0; t < threads_; ++t) {
      const int64_t begin = std::min(n, t * share), end = std::min(n, begin + share);
      ranges_[t].bounds.store(pack(begin, end), std::memory_order_relaxed);
    }
  }

  // Whether thread t's own range goes on with `item` (as it stands: a thief may yet take it).
  // A kernel fetches a panel ahead only for itself: the other thread reads its own.
  bool continues_with(int64_t t, int64_t item) const {
    const uint64_t bounds = ranges_[t].bounds.load(std::memory_order_relaxed);
    return begin_of(bounds) == item && item < end_of(bounds);
  }

  // Items left in thread t's own range (as it stands: a thief may yet take some).
  int64_t own_left(int64_t t) const {
    const uint64_t bounds = ranges_[t].bounds.load(std::memory_order_relaxed);
    return std::max<int64_t>(end_of(bounds) - begin_of(bounds), 0);
  }

  // Thread t's next item: the front of its own range, else the back of the first other
  // range with items left; -1 once every range is empty.
  int64_t next(int64_t t) {
    const int64_t own = take_front(ranges_[t]);
    if (own >= 0) return own;
    for (int64_t i = 1; i < threads_; ++i) {
      const int64_t stolen = take_back(ranges_[(t + i) % threads_]);
      if (stolen >= 0) return stolen;
    }
    return -1;
  }

 private:
  // [begin, end) in one word, so the owner's front and a thief's back never both take the
  // last item.
  struct alignas(64) Range {
    std::atomic<uint64_t> bounds{0};
  };

  static uint64_t pack(int64_t begin, int64_t end) {
    return static_cast<uint64_t>(begin) | static_cast<uint64_t>(end) << 32;
  }
  static int64_t begin_of(uint64_t bounds) { return static_cast<int64_t>(bounds & 0xffffffffu); }
  static int64_t end_of(uint64_t bounds) { return static_cast<int64_t>(bounds >> 32); }

  static int64_t take_front(Range& range) {
    uint64_t bounds = range.bounds.load(std::memory_order_relaxed);
    while (begin_of(bounds) < end_of(bounds)) {
      const int64_t item = begin_of(bounds);
      if (range.bounds.compare_exchange_weak(bounds, pack(item + 1, end_of(bounds)),
                                             std::memory_order_relaxed)) {
        return item;
      }
    }
    return -1;
  }

  static int64_t take_back(Range& range) {
    uint64_t bounds = range.bounds.load(std::memory_order_relaxed);
    while (begin_of(bounds) < end_of(bounds)) {
      const int64_t item = end_of(bounds) - 1;
      if (range.bounds.compare_exchange_weak(bounds, pack(begin_of(bounds), item),
                                             std::memory_order_relaxed)) {
        return item;
      }
    }
    return -1;
  }

  int64_t threads_;
  std::unique_ptr<Range[]> ranges_;
};

// One thread's view of the ranges.
class StealingCursor {
 public:
  StealingCursor(StealingRanges& ranges, int64_t thread) : ranges_(ranges), thread_(thread) {}

  // The thread's next item, or -1 when none is left.
  int64_t next() { return ranges_.next(thread_); }
  // Whether the item after this one is this thread's own next (see continues_with).
  bool continues_with(int64_t item) const { return ranges_.continues_with(thread_, item); }
  // Items left in this thread's own range.
  int64_t own_left() const { return ranges_.own_left(thread_); }

 private:
  StealingRanges& ranges_;
  int64_t thread_;
};

// worker(cursor) on each of torch's threads, each taking items of [0, n) (fewer than 2^31)
// from its StealingCursor. Inside another parallel region, one call takes them all.
template <typename Worker>
void parallel_stealing(int64_t n, const Worker& worker) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(n, at::get_num_threads());
  StealingRanges ranges(n, threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      StealingCursor cursor(ranges, t);
      worker(cursor);
    }
  });
}

// How many of `left` items to take into the next group of at most kMax: the fewest groups,
// as even as they come (6 items: 3 and 3; 10: 4, 3 and 3), so no item streams alone while a
// group could have taken it. With nothing left of its own (stealing), kMax.
// The one-row GEMVs read a group's panels side by side (panel_gemv.h, bf16_pairs_linear.cpp).
// Taken 4 at a time with the rest one by one, SmolLM2's float32 q/k/v (20 panels) and o and
// down (12 each) left each of two threads 4+4+1+1 and 4+1+1 panels: 6 of a thread's 22 read
// as a single stream. On the Zen 4 VM, its 120 projections at one row from Python, old and
// new alternating round by round in one process (12 rounds, the same bits): 10.41 against
// 9.92 ms and 12.55 against 11.84 (medians); bfloat16 (18 and 30 panels) alike, 9.31 against
// 9.37.
template <int kMax>
int group_size(int64_t left) {
  if (left <= 0) return kMax;
  const int64_t groups = (left + kMax - 1) / kMax;
  return static_cast<int>((left + groups - 1) / groups);
}

// The thread's items through `run(items, count)`, in groups of at most kMax (group_size's),
// each group's items in the order taken; what is left when the items run out, as a group.
template <int kMax, typename Run>
void for_each_group(StealingCursor& cursor, const Run& run) {
  int64_t items[kMax];
  int taken = 0;
  int target = group_size<kMax>(cursor.own_left());
  for (int64_t item = cursor.next(); item >= 0; item = cursor.next()) {
    items[taken++] = item;
    if (taken == target) {
      run(items, taken);
      taken = 0;
      target = group_size<kMax>(cursor.own_left());
    }
  }
  if (taken > 0) run(items, taken);
}

// f(std::integral_constant<int, count>{}) for a count in [1, kMax]: a group's size as a
// template argument, so each size's loop keeps its accumulators in registers.
template <int kMax, typename F>
void with_count(int count, const F& f) {
  if constexpr (kMax >= 1) {
    if (count == kMax) {
      f(std::integral_constant<int, kMax>{});
    } else {
      with_count<kMax - 1>(count, f);
    }
  }
}

// One thread's view of several rounds of items, each round split as parallel_stealing
// splits its items: the thread takes its share of a round (and what it can take from the
// others') before it moves to the next round, without waiting for the other threads there.
class RoundsCursor {
 public:
  RoundsCursor(std::vector<StealingRanges>& rounds, int64_t thread)
      : rounds_(rounds), thread_(thread) {}

  // The thread's next (round, item), or (-1, -1) when no round has items left.
  std::pair<int64_t, int64_t> next() {
    for (; round_ < static_cast<int64_t>(rounds_.size()); ++round_) {
      const int64_t item = rounds_[round_].next(thread_);
      if (item >= 0) return {round_, item};
    }
    return {-1, -1};
  }

 private:
  std::vector<StealingRanges>& rounds_;
  int64_t thread_;
  int64_t round_ = 0;
};

// worker(cursor) on each of torch's threads, each taking (round, item) pairs, items of [0, n)
// in each of `rounds` rounds, from its RoundsCursor. Inside another parallel region, one call
// takes them all.
template <typename Worker>
void parallel_stealing_rounds(int64_t rounds, int64_t n, const Worker& worker) {
  if (n <= 0 || rounds <= 0) return;
  const int64_t threads = std::min<int64_t>(n, at::get_num_threads());
  std::vector<StealingRanges> ranges;
  ranges.reserve(rounds);
  for (int64_t round = 0; round < rounds; ++round) ranges.emplace_back(n, threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      RoundsCursor cursor(ranges, t);
      worker(cursor);
    }
  });
}

}  // namespace duoserve
