// Adaptive spinning before a blocking wait (docs/architecture.md, "Adaptive
// spin"). A thread about to sleep on a connection may poll it
// for a short while first: a reply, or the peer's next request, often comes
// within microseconds, and waking a sleeping thread costs about as much as
// the whole call on a virtual machine. Spinning only pays while the peer has
// a core of its own; on a busy machine the spinner holds the core the peer
// (or other work) needs, and the call gets slower. So each thread measures
// both ways of waiting and uses the cheaper: the cost of a wait is how long
// it took (capped) plus, when the spin ran out, the CPU the spin burnt. The
// way not in use is still tried now and then, so the choice follows the load.
#pragma once

#include <chrono>
#include <cstdint>

namespace moolib {

struct SpinStats {
  uint64_t waits = 0;  // waits that could have spun
  uint64_t spins = 0;  // waits that spun
  uint64_t hits = 0;   // spins that ended in an event
};

class SpinPolicy {
 public:
  // A thread that blocks tries a spin once every kExploreSpin waits, to see
  // when the load has gone (a spin that runs out costs one budget). One that
  // spins tries blocking only once every kExploreBlock waits: its peer,
  // spinning too, then waits longer for it and counts that against spinning.
  // Load that comes shows in the spins themselves (they run out, or wait
  // longer).
  static constexpr uint32_t kExploreSpin = 64;
  static constexpr uint32_t kExploreBlock = 512;
  // A spin yields its core between polls, so that a thread waiting for that
  // core (a learner, an actor loop, torch's pool) runs meanwhile. But a yield
  // to a thread that never blocks (an env worker stepping, a busy neighbour)
  // can lose the core for that thread's whole time slice: the spinner is not
  // asleep, so the reply that comes does not wake it ahead of the other
  // thread. A yield that took kLostCore or more stops this thread's spins
  // from yielding for its next kMinNoYield waits; a loss right after such a
  // pause doubles the pause, up to kMaxNoYield waits. So among threads that
  // never block, yields stop but for a try every few thousand waits, and
  // beside ones that block now and then (a learner), they go on.
  static constexpr std::chrono::microseconds kLostCore{1000};
  static constexpr uint32_t kMinNoYield = 64;
  static constexpr uint32_t kMaxNoYield = 4096;
  // Past this many budgets, how much longer a wait took says nothing about
  // how it waited (the peer was simply idle).
  static constexpr int64_t kCostCap = 4;
  // A spin pays only if it lasts until the event: a peer that blocks takes a
  // wake-up and its work to answer, and a wake-up costs 2-30 us depending on
  // the machine and its load. So a thread's budget follows how long its
  // blocked waits take until their event (a running median: on a busy
  // machine a few take a time slice, and would pull a mean up), from
  // budget() up to kMaxBudgetFactor times it. Otherwise, on a machine whose
  // idle CPUs wake slowly, two peers that both block never find that
  // spinning pays: each one's trial spins end before the other's answer
  // comes. Waits that end without an event (an idle peer) do not count.
  static constexpr int64_t kMaxBudgetFactor = 4;

  // Whether this wait's spin may yield its core between polls (kLostCore).
  bool mayYield() const { return noYield_ == 0; }
  // A yield of this wait's spin took `took`; false once spins stop yielding.
  bool yielded(std::chrono::nanoseconds took);

  // How long this thread should spin before its next wait (zero: block at
  // once): its budget, between budget() and kMaxBudgetFactor times it.
  // begin() and end() are called only while budget() is not zero.
  std::chrono::nanoseconds begin();
  // The wait begun last took `waited` in all; `hit`: the event came while
  // spinning; `event`: it came at all (not a timeout).
  void end(std::chrono::nanoseconds waited, bool hit, bool event);

  // This thread's budget now: budget() stretched to its blocked waits.
  std::chrono::nanoseconds threadBudget() const;

  // This thread's policy.
  static SpinPolicy& current();
  // Totals over every thread of this process.
  static SpinStats stats();
  // The spin budget: MOOLIB_SPIN_US (20 us when unset; 0 turns spinning
  // off), and zero where this process may run on one CPU only, or has less
  // than two CPUs' time (a cgroup CPU quota) (docs/architecture.md,
  // "Adaptive spin").
  static std::chrono::nanoseconds budget();

 private:
  enum Way { kBlock = 0, kSpin = 1 };
  // Mean cost of a wait each way (ns, moving average). A thread starts out
  // spinning, since the gain shows only once both ends of a connection spin;
  // until it has blocked, blocking is taken to cost as much as any wait can
  // count (kCostCap budgets), so spins that keep running out turn it to
  // blocking within a dozen waits.
  int64_t cost_[2] = {kCostCap * budget().count(), 0};
  // The median blocked wait until an event (ns), within the bounds of the budget.
  int64_t blocked_ = budget().count();
  uint32_t noYield_ = 0;                  // waits left whose spins do not yield
  uint32_t noYieldPeriod_ = kMinNoYield;  // the last pause's length
  uint32_t lastLoss_ = 0;                 // count_ at the last lost yield
  uint32_t count_ = 0;
  Way way_ = kBlock;  // of the current wait
};

}  // namespace moolib
