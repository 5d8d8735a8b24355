#include "replay/rate_limiter.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "runtime/error.h"

namespace moolib::replay {

namespace {

std::string seconds(double x) {
  std::ostringstream ss;
  ss.setf(std::ios::fixed);
  ss.precision(1);
  ss << x;
  return ss.str();
}

TimePoint deadlineAfter(double seconds) {
  if (!(seconds < 1e9)) return kForever;
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(std::max(0.0, seconds)));
}

}  // namespace

void RateLimiter::validate(const RateLimits& l, int64_t capacity) {
  auto bad = [](const std::string& m) { throw std::invalid_argument(m); };
  if (l.minSize < 1) bad(concat("replay min_size must be at least 1, got ", l.minSize));
  if (l.minSize > capacity) {
    bad(concat("replay min_size ", l.minSize, " exceeds the capacity ", capacity,
               ": sampling could never start"));
  }
  if (l.samplesPerInsert > 0) {
    if (!std::isfinite(l.samplesPerInsert)) bad("replay samples_per_insert must be finite");
    // Inserts need room diff + spi <= max_diff, samples diff - 1 >= min_diff:
    // both can happen from some diff only if max_diff - min_diff >= spi + 1,
    // and to keep every batch moving item by item we ask, as Reverb does,
    // for 2 * max(1, spi).
    double need = std::max(1.0, l.samplesPerInsert);
    if (!std::isfinite(l.errorBuffer) || l.errorBuffer < need) {
      bad(concat("replay error_buffer ", l.errorBuffer, " is too small for samples_per_insert ",
                 l.samplesPerInsert, ": it must be at least max(1, samples_per_insert) = ", need,
                 ", or inserts and samples could block each other for good"));
    }
  } else if (l.samplesPerInsert < 0) {
    bad(concat("replay samples_per_insert must be positive, got ", l.samplesPerInsert));
  }
}

void RateLimiter::setLimits(const RateLimits& limits) {
  limits_ = limits;
  wakeAll();
}

bool RateLimiter::canInsert(int64_t size) const {
  double spi = limits_.samplesPerInsert;
  if (spi <= 0 || size < limits_.minSize) return true;
  double diff = double(inserts_) * spi - double(samples_);
  double maxDiff = spi * double(limits_.minSize) + limits_.errorBuffer;
  return diff + spi <= maxDiff + 1e-9 * std::max(1.0, std::abs(maxDiff));
}

bool RateLimiter::canSample(int64_t size) const {
  if (size < limits_.minSize) return false;
  double spi = limits_.samplesPerInsert;
  if (spi <= 0) return true;
  double diff = double(inserts_) * spi - double(samples_);
  double minDiff = spi * double(limits_.minSize) - limits_.errorBuffer;
  return diff - 1 >= minDiff - 1e-9 * std::max(1.0, std::abs(minDiff));
}

void RateLimiter::restore(int64_t inserts, int64_t samples) {
  inserts_ = inserts;
  samples_ = samples;
}

RateLimiter::Wait::Wait(double seconds) : deadline_(deadlineAfter(seconds)) {}

bool RateLimiter::awaitInsert(std::unique_lock<std::mutex>& lock, Wait& wait,
                              const std::function<bool()>& ready) {
  return await(lock, insertCv_, waitingInserters_, wait, ready);
}

bool RateLimiter::awaitSample(std::unique_lock<std::mutex>& lock, Wait& wait,
                              const std::function<bool()>& ready) {
  return await(lock, sampleCv_, waitingSamplers_, wait, ready);
}

bool RateLimiter::await(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                        int64_t& waiting, Wait& wait, const std::function<bool()>& ready) {
  if (Clock::now() >= wait.deadline_) return false;
  if (!wait.blocking_) {
    lock.unlock();
    wait.blocking_.emplace();
    lock.lock();
    return true;
  }
  ++waiting;
  bool timedOut = cv.wait_until(lock, wait.deadline_) == std::cv_status::timeout;
  --waiting;
  return !(timedOut && !ready());
}

void RateLimiter::wakeAll() {
  insertCv_.notify_all();
  sampleCv_.notify_all();
}

std::string RateLimiter::insertTimeout(int64_t n, int64_t done, double waited) const {
  double spi = limits_.samplesPerInsert;
  double maxDiff = spi * double(limits_.minSize) + limits_.errorBuffer;
  double need = double(inserts_) * spi + spi - maxDiff;
  return concat("replay insert of ", n, " waited ", seconds(waited), " s (", done,
                " inserted): inserters are ahead of samplers: ", inserts_, " items inserted and ",
                samples_, " sampled; samples_per_insert ", spi, " with error_buffer ",
                limits_.errorBuffer, " needs ", std::ceil(need), " samples before the next insert");
}

std::string RateLimiter::sampleTimeout(int64_t n, int64_t done, double waited, int64_t size) const {
  std::string head =
      concat("replay sample of ", n, " waited ", seconds(waited), " s (", done, " sampled): ");
  if (size < limits_.minSize) {
    return head + concat(size, " items in the table, min_size ", limits_.minSize);
  }
  double spi = limits_.samplesPerInsert;
  double minDiff = spi * double(limits_.minSize) - limits_.errorBuffer;
  return head + concat("samplers are ahead of inserters: ", samples_, " items sampled for ",
                       inserts_, " inserted; samples_per_insert ", spi, " with error_buffer ",
                       limits_.errorBuffer, " allows ",
                       std::floor(double(inserts_) * spi - minDiff),
                       " samples until more items are inserted");
}

}  // namespace moolib::replay
