// Profiling counters of the CPU layer kernels: with `ns` non-null, each lap adds the time since
// the previous one to counter `part` (0: matrix products, 1: elementwise work).
#pragma once

#include <cstdint>
#include <ctime>

namespace vmkv {

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

constexpr int kGemmPart = 0, kElementwisePart = 1;

struct Lap {
  int64_t* ns;  // nullptr: not profiling (no clock reads)
  int64_t start;
  explicit Lap(int64_t* counters) : ns(counters), start(counters ? now_ns() : 0) {}
  void operator()(int part) {
    if (ns == nullptr) return;
    const int64_t t = now_ns();
    ns[part] += t - start;
    start = t;
  }
};

}  // namespace vmkv
