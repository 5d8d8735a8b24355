// The UCX transport's runtime, one per process: UCP's context and worker,
// the worker's progress (by the loop, through its event fd, or by a thread
// that owns it) and what UCX's callbacks recorded, run outside its mutex.
// Its connections and listeners are connection_impl.h's.
#pragma once

#include "transport/ucx/ucx_api.h"

#if MOOLIB_UCX_HEADERS

#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "runtime/loop.h"
#include "transport/ownership.h"

namespace moolib {

class UcxConnection;
class UcxListener;

// The process's UCP context and worker, and their progress on the loop;
// started on first use (a UCX listener or dial). Every UCX call is made
// under its mutex; UCX callbacks only record what happened (under it), and
// runDeferred runs that afterwards, outside it.
//
// One thread at a time may own the worker's progress, as a stream
// connection's fd is owned (transport/ownership.h; docs/architecture.md,
// "UCX"): a caller waiting for a reply, or the loop worker that just handed
// requests up (the sticky worker). Its event fd is then out of the loop's
// epoll set, so what arrives wakes only the owner, which progresses UCX
// itself.
class UcxRuntime : public FdHandler, public std::enable_shared_from_this<UcxRuntime> {
 public:
  // The runtime of this process (made on first use); nullptr with the reason.
  static std::shared_ptr<UcxRuntime> get(std::string& whyNot);
  UcxRuntime(const UcxApi& api, ucp_context_h context, ucp_worker_h worker, int efd);

  void onEvents(uint32_t events) override;
  // Serves the worker by itself while requests keep coming (Loop::workerMain),
  // running them inline; false at once if another thread owns it.
  bool serveSticky(TimePoint deadline) override;
  // The inline requests ran long or blocked: the loop serves UCX again.
  void takeBack() override;
  // Progresses the worker until idle and arms it (mutex held by the caller);
  // whether anything progressed.
  bool progressLocked();
  // One progress of the worker (takes the mutex), without arming it; whether
  // anything progressed. What it brought is handed up by runDeferred.
  bool progressOnce();
  // Runs what callbacks recorded: tasks, then frames of the connections that
  // got any. Call without the mutex after anything that may have called back.
  void runDeferred();
  // Progresses and runs what that recorded until nothing is left, leaving the
  // worker armed for a wait on its event fd: a UCX call made after
  // ucp_worker_arm (a reply sent by a frame handed up) may take an event the
  // fd would have announced. Without the mutex; whether anything progressed.
  bool settle();
  // Progresses now and then while sends are in flight, in case UCX wants
  // progress the event fd does not announce.
  void ensurePollingLocked();
  // Takes the worker's progress from the loop; false if another thread has
  // it. A thread whose inline requests were lent it takes it back.
  bool claim();
  // Hands the progress back to the loop.
  void unown();
  // The owner progresses on this thread until done() or the deadline: polls
  // UCX for as long as its spin policy says, then sleeps on the event fd.
  void serve(const std::function<bool()>& done, TimePoint deadline);

  const UcxApi& api;
  std::mutex mutex;  // every UCX call, and the state below
  ucp_context_h context;
  ucp_worker_h worker;
  std::vector<Task> deferred;                         // run by runDeferred
  std::vector<std::shared_ptr<UcxConnection>> dirty;  // have frames to hand up
  // Connections whose endpoint or requests are alive (UCX holds raw
  // pointers to them), and listeners likewise.
  std::set<std::shared_ptr<UcxConnection>> live;
  std::set<std::shared_ptr<UcxListener>> listeners;
  size_t sendsInFlight = 0;
  bool polling = false;
  // Connections over UCX's TCP alone receiving a large segment (bulkLocked).
  size_t bulkReceives = 0;

 private:
  // Progresses what came meanwhile and hands the event fd back to the loop,
  // unless a thread owns the worker again; after the owner let go.
  void letGo();
  // One wait of the owner; true if UCX progressed.
  bool waitOnce(const std::function<bool()>& done, TimePoint deadline);
  // The owner polls while a large segment comes in over UCX's TCP (see
  // kBulkQuiet); whether anything progressed.
  bool pollBulk();

  int efd_;
  // Who progresses the worker: the loop, through the event fd, or a thread
  // that owns it; lent by the sticky worker to the requests it runs inline,
  // one of which may take it over (claim).
  IoOwnership own_{mutex};
};

}  // namespace moolib

#endif
