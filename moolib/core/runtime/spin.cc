#include "runtime/spin.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "runtime/logging.h"

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

constexpr double kNoQuota = std::numeric_limits<double>::infinity();

// The CPU quota of one cgroup directory, in CPUs: cgroup v2's cpu.max
// ("QUOTA PERIOD", or "max PERIOD") or v1's cpu.cfs_quota_us (-1: none) over
// cpu.cfs_period_us.
double quotaAt(const std::string& dir) {
  if (std::ifstream max(dir + "/cpu.max"); max) {
    std::string quota;
    double period = 0;
    if (max >> quota >> period && quota != "max" && period > 0) {
      return std::strtod(quota.c_str(), nullptr) / period;
    }
    return kNoQuota;
  }
  std::ifstream quotaFile(dir + "/cpu.cfs_quota_us"), periodFile(dir + "/cpu.cfs_period_us");
  double quota = -1, period = 0;
  if (quotaFile >> quota && periodFile >> period && quota > 0 && period > 0) return quota / period;
  return kNoQuota;
}

// The smallest CPU quota on the way from this process's cgroup to the root,
// in CPUs. A container limited to one CPU's time (docker --cpus=1) sees every
// core of its host in its affinity, yet a spin there spends its quota.
double cgroupCpuQuota() {
  std::ifstream self("/proc/self/cgroup");
  std::string line;
  double cpus = kNoQuota;
  while (std::getline(self, line)) {
    // "ID:CONTROLLERS:PATH": v2 is "0::PATH"; v1's CPU controller is listed
    // alone or as "cpu,cpuacct".
    size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    std::vector<std::string> roots;
    if (line.compare(0, 3, "0::") == 0) {
      roots = {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"};
    } else if (("," + controllers + ",").find(",cpu,") != std::string::npos) {
      roots = {"/sys/fs/cgroup/" + controllers};
      if (controllers != "cpu") roots.push_back("/sys/fs/cgroup/cpu");
    }
    for (const std::string& root : roots) {
      for (std::string dir = path;; dir = dir.substr(0, dir.rfind('/'))) {
        cpus = std::min(cpus, quotaAt(root + dir));
        if (dir.empty() || dir == "/") break;
      }
    }
  }
  return cpus;
}

long readBudgetUs() {
  cpu_set_t cpus;
  // One CPU, or one CPU's time: the peer cannot run while we spin.
  if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0 && CPU_COUNT(&cpus) < 2) return 0;
  if (cgroupCpuQuota() < 2) return 0;
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

bool SpinPolicy::yielded(std::chrono::nanoseconds took) {
  if (took < kLostCore) return true;
  // Lost again right after the last pause: pause twice as long.
  bool again = lastLoss_ != 0 && count_ - lastLoss_ < 2 * noYieldPeriod_;
  noYieldPeriod_ = again ? std::min(2 * noYieldPeriod_, kMaxNoYield) : kMinNoYield;
  lastLoss_ = count_;
  noYield_ = noYieldPeriod_;
  return false;
}

std::chrono::nanoseconds SpinPolicy::begin() {
  gWaits.fetch_add(1, std::memory_order_relaxed);
  if (noYield_) --noYield_;
  Way preferred = cost_[kSpin] < cost_[kBlock] ? kSpin : kBlock;
  uint32_t period = preferred == kSpin ? kExploreBlock : kExploreSpin;
  way_ = ++count_ % period == 0 ? Way(1 - preferred) : preferred;
  if (way_ == kBlock) return std::chrono::nanoseconds{0};
  gSpins.fetch_add(1, std::memory_order_relaxed);
  return threadBudget();
}

std::chrono::nanoseconds SpinPolicy::threadBudget() const {
  return std::chrono::nanoseconds{blocked_};
}

void SpinPolicy::end(std::chrono::nanoseconds waited, bool hit, bool event) {
  int64_t base = budget().count();
  int64_t cost = std::min<int64_t>(waited.count(), kCostCap * base);
  if (way_ == kSpin) {
    if (hit) {
      gHits.fetch_add(1, std::memory_order_relaxed);
    } else {
      cost += blocked_;  // the CPU burnt for nothing: this thread's whole budget
    }
  } else if (event) {
    // A step of 1/16 of the base budget a wait, toward the side the wait fell on.
    blocked_ += waited.count() > blocked_ ? base >> 4 : -(base >> 4);
    blocked_ = std::clamp(blocked_, base, kMaxBudgetFactor * base);
  }
  int64_t& avg = cost_[way_];
  avg += (cost - avg) >> kShift;
}

SpinStats SpinPolicy::stats() {
  return {gWaits.load(std::memory_order_relaxed), gSpins.load(std::memory_order_relaxed),
          gHits.load(std::memory_order_relaxed)};
}

}  // namespace moolib
