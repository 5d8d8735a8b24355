#include "spin.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "logging.h"

namespace moolib {

namespace {

// Moving averages weigh a new wait by 1 / 2^kShift.
constexpr int kShift = 3;

std::atomic<uint64_t> gWaits{0};
std::atomic<uint64_t> gSpins{0};
std::atomic<uint64_t> gHits{0};

// Beside other work a 50 us budget's trial spins cost measurably per call;
// 20 us did not, and covers a tiny call's turn-around.
constexpr long kDefaultBudgetUs = 20;

long readBudgetUs() {
  cpu_set_t cpus;
  // One CPU: the peer cannot run while we spin.
  if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0 && CPU_COUNT(&cpus) < 2) return 0;
  const char* env = std::getenv("MOOLIB_SPIN_US");
  if (!env || !*env) return kDefaultBudgetUs;
  char* end = nullptr;
  long us = std::strtol(env, &end, 10);
  if (*end != '\0' || us < 0) {
    MOO_LOG(kError, "MOOLIB_SPIN_US='", env,
            "' is not a whole number of microseconds (0 or more): not spinning");
    return 0;
  }
  return std::min(us, 10'000L);
}

}  // namespace

std::chrono::nanoseconds SpinPolicy::budget() {
  static const std::chrono::nanoseconds ns = std::chrono::microseconds(readBudgetUs());
  return ns;
}

SpinPolicy& SpinPolicy::current() {
  thread_local SpinPolicy policy;
  return policy;
}

std::chrono::nanoseconds SpinPolicy::begin() {
  auto spin = budget();
  if (spin.count() == 0) return spin;
  gWaits.fetch_add(1, std::memory_order_relaxed);
  Way preferred = cost_[kSpin] < cost_[kBlock] ? kSpin : kBlock;
  uint32_t period = preferred == kSpin ? kExploreBlock : kExploreSpin;
  way_ = ++count_ % period == 0 ? Way(1 - preferred) : preferred;
  if (way_ == kBlock) return std::chrono::nanoseconds{0};
  gSpins.fetch_add(1, std::memory_order_relaxed);
  return spin;
}

void SpinPolicy::end(std::chrono::nanoseconds waited, bool hit) {
  auto spin = budget();
  if (spin.count() == 0) return;
  int64_t cost = std::min<int64_t>(waited.count(), kCostCap * spin.count());
  if (way_ == kSpin) {
    if (hit) {
      gHits.fetch_add(1, std::memory_order_relaxed);
    } else {
      cost += spin.count();  // the CPU burnt for nothing
    }
  }
  int64_t& avg = cost_[way_];
  avg += (cost - avg) >> kShift;
}

SpinStats SpinPolicy::stats() {
  return {gWaits.load(std::memory_order_relaxed), gSpins.load(std::memory_order_relaxed),
          gHits.load(std::memory_order_relaxed)};
}

}  // namespace moolib
