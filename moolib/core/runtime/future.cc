#include "runtime/future.h"

#include <algorithm>
#include <utility>

namespace moolib {

FutureState::~FutureState() {
  if (!claimed_) return;
  if (auto conn = serve_.lock()) conn->unclaim();
}

bool FutureState::setResult(std::vector<BufferPtr> segments) {
  return complete(std::move(segments), {}, false);
}

bool FutureState::setError(Error error) {
  if (!error) error = Error(ErrorCode::kFailed, "unknown error");
  return complete({}, std::move(error), false);
}

bool FutureState::cancel() {
  return complete({}, Error(ErrorCode::kCancelled, "the call was cancelled"), true);
}

bool FutureState::complete(std::vector<BufferPtr> segments, Error error, bool cancelled) {
  std::vector<Task> callbacks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_.load(std::memory_order_relaxed)) return false;
    result_ = std::move(segments);
    error_ = std::move(error);
    cancelled_ = cancelled;
    done_.store(true, std::memory_order_release);
    // Notified under the lock: a waiter leaves wait() only after taking it, so
    // its (thread-local) Waiter cannot be gone, its eventfd closed and the
    // number reused, while it is written to here.
    Waiter* self = existingWaiter();  // not created here: completing must not need a descriptor
    // The poller re-checks its own condition after each round anyway.
    if (waiter_ && waiter_ != self) waiter_->notify();
    waiter_ = nullptr;
    for (Waiter* w : moreWaiters_) {
      if (w != self) w->notify();
    }
    moreWaiters_.clear();
    callbacks.swap(callbacks_);
  }
  for (auto& cb : callbacks) Loop::instance().schedule(std::move(cb));
  return true;
}

bool FutureState::wait(TimePoint deadline) {
  Waiter* self = &currentWaiter();
  std::weak_ptr<ReplySource> serve;
  bool claimed, finished;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    claimed = std::exchange(claimed_, false);
    serve = serve_;
    finished = done_.load(std::memory_order_relaxed);
    if (!finished && !waiter_) {
      waiter_ = self;
    } else if (!finished) {
      moreWaiters_.push_back(self);
    }
  }
  if (finished) {
    if (auto conn = claimed ? serve.lock() : nullptr) conn->unclaim();
    return true;
  }
  std::function<bool()> isDone = [this] { return done(); };
  // A pool worker waiting here must not leave the pool short of the worker
  // that may have to run what it waits for (a nested call back into this
  // process).
  BlockingRegion blocking;
  bool serving = !serve.expired();
  if (auto conn = claimed ? serve.lock() : nullptr) conn->serveWhile(isDone, deadline, true);
  while (!done() && Clock::now() < deadline) {
    if (serving) {
      auto conn = serve.lock();
      serving = conn && conn->serveWhile(isDone, deadline);
    }
    // Someone else handles that connection: they will notify us.
    if (!serving) self->sleepUntil(deadline);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (waiter_ == self) {
    waiter_ = nullptr;
  } else {
    auto it = std::find(moreWaiters_.begin(), moreWaiters_.end(), self);
    if (it != moreWaiters_.end()) moreWaiters_.erase(it);
  }
  return done();
}

void FutureState::setServe(std::weak_ptr<ReplySource> conn, bool claimed) {
  std::lock_guard<std::mutex> lock(mutex_);
  serve_ = std::move(conn);
  claimed_ = claimed;
}

void FutureState::onDone(Task fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_.load(std::memory_order_relaxed)) {
      callbacks_.push_back(std::move(fn));
      return;
    }
  }
  Loop::instance().schedule(std::move(fn));
}

}  // namespace moolib
