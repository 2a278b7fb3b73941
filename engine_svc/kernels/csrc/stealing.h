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
