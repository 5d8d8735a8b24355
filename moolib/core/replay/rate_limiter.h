// A replay table's rate limiter, Reverb's: with diff = inserts * SPI -
// samples, counted per item, an insert may go while size < minSize or
// diff + SPI <= maxDiff, a sample while size >= minSize and diff - 1 >=
// minDiff, where minDiff/maxDiff = SPI * minSize -/+ errorBuffer. It also
// holds the waits of the calls it holds back: a condition variable for each
// side, waited on under the table's lock. docs/architecture.md (section "The
// replay table") explains the choices.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>

#include "runtime/loop.h"

namespace moolib::replay {

struct RateLimits {
  int64_t minSize = 1;
  // samplesPerInsert <= 0: no ratio is enforced (only minSize).
  double samplesPerInsert = 0;
  double errorBuffer = 0;
};

// Every call but the constructor and validate is made under the table's lock.
class RateLimiter {
 public:
  explicit RateLimiter(const RateLimits& limits) : limits_(limits) {}
  RateLimiter(const RateLimiter&) = delete;
  RateLimiter& operator=(const RateLimiter&) = delete;

  // Throws std::invalid_argument unless the limits can make progress in a
  // table of `capacity` items.
  static void validate(const RateLimits& limits, int64_t capacity);

  const RateLimits& limits() const { return limits_; }
  // New (validated) limits; wakes every waiter to look again.
  void setLimits(const RateLimits& limits);

  // Whether one more item may be inserted, or sampled, in a table of `size`.
  bool canInsert(int64_t size) const;
  bool canSample(int64_t size) const;
  void inserted() { ++inserts_; }
  void sampled() { ++samples_; }
  int64_t inserts() const { return inserts_; }
  int64_t samples() const { return samples_; }
  // The counters of a restored table.
  void restore(int64_t inserts, int64_t samples);

  // A call's wait, over all its rounds; made before the lock is taken and
  // ended after it is released (it may hold a BlockingRegion).
  class Wait {
   public:
    // Up to `seconds` in all; 1e9 or more waits for good.
    explicit Wait(double seconds);

   private:
    friend class RateLimiter;
    TimePoint deadline_;
    std::optional<BlockingRegion> blocking_;
  };
  // One round of a rate-limited wait, with the table's lock held in `lock`:
  // false once the deadline has passed and `ready()` (the call may go on, or
  // the table closed) is still false; true to look again. The first round
  // only enters the pool's BlockingRegion, unlocked (a pool worker hands its
  // pending work to others there), so a handler blocked here gets a spare.
  bool awaitInsert(std::unique_lock<std::mutex>& lock, Wait& wait,
                   const std::function<bool()>& ready);
  bool awaitSample(std::unique_lock<std::mutex>& lock, Wait& wait,
                   const std::function<bool()>& ready);
  // Inserts wake the samplers waiting, samples the inserters.
  void wakeInserters() { insertCv_.notify_all(); }
  void wakeSamplers() { sampleCv_.notify_all(); }
  void wakeAll();
  int64_t waitingInserters() const { return waitingInserters_; }
  int64_t waitingSamplers() const { return waitingSamplers_; }

  // Why a call of n items that waited `waited` seconds and got `done` done
  // stopped: what it waited for, with the counters.
  std::string insertTimeout(int64_t n, int64_t done, double waited) const;
  std::string sampleTimeout(int64_t n, int64_t done, double waited, int64_t size) const;

 private:
  bool await(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, int64_t& waiting,
             Wait& wait, const std::function<bool()>& ready);

  RateLimits limits_;
  int64_t inserts_ = 0, samples_ = 0;
  std::condition_variable insertCv_, sampleCv_;
  int64_t waitingInserters_ = 0, waitingSamplers_ = 0;
};

}  // namespace moolib::replay
