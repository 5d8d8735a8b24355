// The state shared by a call in flight and whoever waits for it.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/buffer.h"
#include "runtime/error.h"
#include "runtime/loop.h"

namespace moolib {

// What a completion comes from, which the thread waiting for it may serve
// itself meanwhile, so that the completion wakes that very thread (a
// transport's Connection: transport/transport.h).
class ReplySource {
 public:
  virtual ~ReplySource() = default;
  // Lets the calling thread handle this source's I/O itself until done() or
  // the deadline. Returns false at once if another thread is handling it.
  // claimed: the caller took it with a claim beforehand (Connection::claim),
  // and serveWhile hands it back when it returns.
  virtual bool serveWhile(const std::function<bool()>& done, TimePoint deadline,
                          bool claimed = false) = 0;
  // Hands back a claim that no serveWhile took.
  virtual void unclaim() {}
};

class FutureState {
 public:
  FutureState() = default;
  FutureState(const FutureState&) = delete;
  FutureState& operator=(const FutureState&) = delete;
  // Hands back a claim no wait took.
  ~FutureState();

  // The first completion wins; later ones return false.
  bool setResult(std::vector<BufferPtr> segments);
  // error must be one (a code other than kOk).
  bool setError(Error error);
  // Completes with a kCancelled error; false if it already completed.
  bool cancel();

  bool done() const { return done_.load(std::memory_order_acquire); }
  bool cancelled() const { return cancelled_; }
  // Blocks until done or deadline. The caller must not hold the GIL.
  bool wait(TimePoint deadline);
  // Runs fn on a pool worker once done (at once if already done).
  void onDone(Task fn);
  // The connection the completion will come from (the one the request went
  // out on): a waiting thread serves it itself (ReplySource::serveWhile).
  // claimed: the caller holds the connection's claim (Connection::claim),
  // which the first wait takes over.
  void setServe(std::weak_ptr<ReplySource> conn, bool claimed = false);

  // Valid once done(); false (kOk) on success.
  const Error& error() const { return error_; }
  const std::vector<BufferPtr>& result() const { return result_; }

 private:
  bool complete(std::vector<BufferPtr> segments, Error error, bool cancelled);

  mutable std::mutex mutex_;
  std::atomic<bool> done_{false};
  bool cancelled_ = false;
  Error error_;
  std::vector<BufferPtr> result_;
  // Threads waiting; nearly always one (a sync() call), kept without a
  // vector's allocation.
  Waiter* waiter_ = nullptr;
  std::vector<Waiter*> moreWaiters_;
  std::vector<Task> callbacks_;
  std::weak_ptr<ReplySource> serve_;
  bool claimed_ = false;
};
using FuturePtr = std::shared_ptr<FutureState>;

}  // namespace moolib
