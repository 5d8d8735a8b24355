// When a connection writes the frames it queued: the send coalescing that
// every transport shares.
//
// A thread issuing a burst of calls (sends microseconds apart) gets them
// coalesced: held back until a batch is full, the thread waits for a reply
// (serveWhile flushes), or a short timer fires. A lone send goes out at once,
// and so does a call its thread waits for next (a sync call: WaitsNext) and
// whatever a loop worker sends (its replies are corked instead, see
// Corkable).
#pragma once

#include <chrono>
#include <cstddef>

#include "runtime/loop.h"

namespace moolib {

class SendBurst {
 public:
  // How long a held-back burst waits for the timer's flush.
  static constexpr auto kDelay = std::chrono::microseconds(50);

  // Sends of the calling thread in its scope are never held back: it waits
  // for their reply next. Back-to-back sync calls quicker than kGap (over
  // shared memory) would otherwise each be held, and each arm a timer whose
  // wake-up takes a core from the spinning ends.
  class WaitsNext {
   public:
    explicit WaitsNext(bool on) : was_(tlsWaitsNext) { tlsWaitsNext = on || was_; }
    ~WaitsNext() { tlsWaitsNext = was_; }
    WaitsNext(const WaitsNext&) = delete;
    WaitsNext& operator=(const WaitsNext&) = delete;

   private:
    bool was_;
  };

  // Called under the connection's write lock for each frame it queues, with
  // the number queued counting this one: true when the queue is to be written
  // now, false when it is held back (the caller then sets a timer for kDelay).
  bool writeNow(size_t queued) {
    TimePoint now = Clock::now();
    bool burst = now - lastSend_ < kGap && !tlsWaitsNext && !Loop::onWorkerThread();
    lastSend_ = now;
    return (queued == 1 && !burst) || queued >= kFrames;
  }

 private:
  static constexpr auto kGap = std::chrono::microseconds(10);
  static constexpr size_t kFrames = 64;
  static inline thread_local bool tlsWaitsNext = false;
  TimePoint lastSend_{};
};

}  // namespace moolib
