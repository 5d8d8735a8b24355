#include "transport/ucx/runtime.h"

#if MOOLIB_UCX_HEADERS

#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>

#include <algorithm>
#include <utility>

#include "runtime/logging.h"
#include "runtime/spin.h"
#include "transport/ucx/connection_impl.h"
#include "transport/ucx/probe.h"

namespace moolib {

namespace {

// While sends are in flight, the worker is progressed this often in case UCX
// wants progress its event fd does not announce (ensurePollingLocked).
constexpr auto kPollInterval = std::chrono::milliseconds(1);
// A large segment coming in over UCX's TCP alone (UcxConnection's kBulkBytes)
// is polled for, not slept on, until nothing came for this long (the sender
// stalled): docs/decisions/ucx-bulk-polling.md.
constexpr auto kBulkQuiet = std::chrono::milliseconds(2);

}  // namespace

UcxRuntime::UcxRuntime(const UcxApi& a, ucp_context_h c, ucp_worker_h w, int efd)
    : api(a), context(c), worker(w), efd_(efd) {}

std::shared_ptr<UcxRuntime> UcxRuntime::get(std::string& whyNot) {
  static std::mutex m;
  static std::shared_ptr<UcxRuntime> instance;
  static uint64_t generation = 0;
  static std::string failure;
  // A runtime made before fork() belongs to the parent: kept, never used.
  static std::vector<std::shared_ptr<UcxRuntime>> abandoned;
  std::lock_guard<std::mutex> lock(m);
  if (instance && generation == Loop::generation()) return instance;
  if (!instance && generation == Loop::generation() && !failure.empty()) {
    whyNot = failure;
    return nullptr;
  }
  if (instance) abandoned.push_back(std::move(instance));
  generation = Loop::generation();
  failure.clear();
  auto fail = [&](std::string why) -> std::shared_ptr<UcxRuntime> {
    failure = why;
    whyNot = why;
    return nullptr;
  };
  const UcxProbe& probe = UcxProbe::get();
  if (!probe.api) return fail(probe.whyNot);
  const UcxApi* api = probe.api;

  ucp_config_t* config = nullptr;
  ucs_status_t st = api->ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return fail(concat("ucp_config_read: ", api->ucs_status_string(st)));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_STREAM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  ucp_context_h context = nullptr;
  st = api->ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &context);
  api->ucp_config_release(config);
  if (st != UCS_OK) return fail(concat("ucp_init: ", api->ucs_status_string(st)));

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // our mutex serializes every call
  ucp_worker_h worker = nullptr;
  st = api->ucp_worker_create(context, &wp, &worker);
  if (st != UCS_OK) {
    api->ucp_cleanup(context);
    return fail(concat("ucp_worker_create: ", api->ucs_status_string(st)));
  }
  int efd = -1;
  st = api->ucp_worker_get_efd(worker, &efd);
  if (st != UCS_OK) {
    api->ucp_worker_destroy(worker);
    api->ucp_cleanup(context);
    return fail(concat("ucp_worker_get_efd: ", api->ucs_status_string(st)));
  }
  auto rt = std::make_shared<UcxRuntime>(*api, context, worker, efd);
  {
    std::lock_guard<std::mutex> l(rt->mutex);
    rt->own_.attachLocked(efd, Loop::instance().addFd(efd, EPOLLIN, rt), true);
    // Armed before the first wait, as UCX asks.
    rt->progressLocked();
  }
  MOO_LOG(kVerbose, "UCX ", api->ucp_get_version_string(), " started: ", probe.domain);
  instance = rt;
  return rt;
}

bool UcxRuntime::progressLocked() {
  bool progressed = false;
  for (;;) {
    while (api.ucp_worker_progress(worker) != 0) progressed = true;
    ucs_status_t st = api.ucp_worker_arm(worker);
    if (st != UCS_ERR_BUSY) return progressed;
  }
}

bool UcxRuntime::progressOnce() {
  std::lock_guard<std::mutex> lock(mutex);
  return api.ucp_worker_progress(worker) != 0;
}

bool UcxRuntime::settle() {
  bool progressed = false;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      progressed |= progressLocked();
      if (deferred.empty() && dirty.empty()) return progressed;
    }
    runDeferred();
  }
}

void UcxRuntime::onEvents(uint32_t events) {
  bool bulk;
  {
    std::lock_guard<std::mutex> lock(mutex);
    // The owner, if any, progresses, and re-arms the fd when it lets go.
    own_.firedLocked();
    if (own_.owned()) return;
    bulk = bulkReceives > 0;
    // The fd is disarmed: owning the worker takes nothing from the loop.
    if (bulk) own_.tryOwnLocked();
  }
  if (bulk) {
    pollBulk();
    std::lock_guard<std::mutex> lock(mutex);
    own_.disownLocked();
  }
  letGo();
}

bool UcxRuntime::pollBulk() {
  bool any = false;
  TimePoint last = Clock::now();
  for (;;) {
    bool progressed;
    {
      std::lock_guard<std::mutex> lock(mutex);
      progressed = api.ucp_worker_progress(worker) != 0;
      if (bulkReceives == 0) return any || progressed;
    }
    TimePoint now = Clock::now();
    if (progressed) {
      any = true;
      last = now;
    } else if (now - last >= kBulkQuiet) {
      return any;
    }
  }
}

void UcxRuntime::letGo() {
  settle();
  std::lock_guard<std::mutex> lock(mutex);
  own_.armLocked(EPOLLIN);
}

bool UcxRuntime::claim() {
  // A request run inline by the owner waits over UCX: it takes the worker,
  // and serveSticky owns it again (if free) when the request is done.
  std::lock_guard<std::mutex> lock(mutex);
  return own_.claimLocked();
}

void UcxRuntime::unown() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    own_.disownLocked();
  }
  letGo();
}

void UcxRuntime::takeBack() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!own_.takeBackLocked()) return;
  }
  letGo();
}

bool UcxRuntime::waitOnce(const std::function<bool()>& done, TimePoint deadline) {
  // Null when spinning is off (MOOLIB_SPIN_US=0): each wait sleeps at once.
  SpinPolicy* spinPolicy = SpinPolicy::budget().count() > 0 ? &SpinPolicy::current() : nullptr;
  Waiter& waiter = currentWaiter();
  // Poll UCX for as long as the thread's spin policy says: a quick reply then
  // costs no wake-up.
  TimePoint start = Clock::now();
  TimePoint spinUntil =
      std::min(deadline, start + (spinPolicy ? spinPolicy->begin() : std::chrono::nanoseconds(0)));
  bool mayYield = spinPolicy && spinPolicy->mayYield();
  bool progressed = false;
  for (;;) {
    progressed = progressOnce();
    TimePoint now = Clock::now();
    if (progressed || now >= spinUntil) break;
    if (mayYield) {
      // Yields give the core to whoever waits for it (SpinPolicy::kLostCore).
      sched_yield();
      mayYield = spinPolicy->yielded(Clock::now() - now);
    }
  }
  if (progressed) {
    // Something came: handed up at once, without progressing until idle or
    // arming the worker, since this thread polls again before it sleeps
    // (each progress over UCX's TCP is an epoll_wait, an arm several calls).
    runDeferred();
    if (spinPolicy) spinPolicy->end(Clock::now() - start, true, true);
    return true;
  }
  // Progressed to the end and armed, as the owner sleeps on the event fd and
  // must be woken by what comes. What that progress brought (a request handed
  // up to run inline, say) is served first.
  progressed = settle();
  bool event = progressed || done();
  bool bulk;
  {
    std::lock_guard<std::mutex> lock(mutex);
    bulk = bulkReceives > 0;
  }
  if (!event && bulk) {
    // Not a wait the spin policy weighs: a transfer under way.
    TimePoint spun = Clock::now();
    progressed = pollBulk();
    if (spinPolicy) spinPolicy->end(spun - start, false, true);
    return progressed;
  }
  bool woke = false;
  if (!event) {
    // Sleep on the event fd and the thread's waiter (another thread may
    // complete what this one waits for, or want the loop's workers).
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    pollfd p[2] = {{efd_, POLLIN, 0}, {waiter.fd(), POLLIN, 0}};
    event = ::poll(p, 2, int(std::clamp<int64_t>(left.count() + 1, 0, 100))) > 0;
    if (p[1].revents) waiter.clear();
    if (p[0].revents) {
      // Progressed within this wait, so that the spin policy weighs the
      // wake-up with what it brought (one wait, not a blocked one and then
      // a spin that hits at once).
      woke = progressOnce();
      if (woke) runDeferred();
    }
  }
  if (spinPolicy) spinPolicy->end(Clock::now() - start, progressed, event);
  return progressed || woke;
}

void UcxRuntime::serve(const std::function<bool()>& done, TimePoint deadline) {
  while (!done() && Clock::now() < deadline) waitOnce(done, deadline);
}

bool UcxRuntime::serveSticky(TimePoint deadline) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!own_.tryOwnLocked()) return false;
  }
  Loop& loop = Loop::instance();
  std::function<bool()> stop = [&loop] { return loop.stickyShouldStop(); };
  bool active = false;
  while (!stop() && Clock::now() < deadline) {
    if (waitOnce(stop, deadline)) active = true;
    // Taken back (a request blocked or ran long), or by a request that
    // waited over UCX and has let go: served on only if it is free again.
    if (Loop::hasInlineTasks() && !own_.runLent(shared_from_this())) return true;
  }
  unown();
  return active;
}
void UcxRuntime::ensurePollingLocked() {
  if (polling || sendsInFlight == 0) return;
  polling = true;
  std::weak_ptr<UcxRuntime> weak = weak_from_this();
  Loop::instance().addTimer(Clock::now() + kPollInterval, [weak] {
    auto self = weak.lock();
    if (!self) return;
    {
      std::lock_guard<std::mutex> lock(self->mutex);
      self->polling = false;
      self->progressLocked();
      self->ensurePollingLocked();
    }
    self->runDeferred();
  });
}

void UcxRuntime::runDeferred() {
  std::vector<Task> tasks;
  std::vector<std::shared_ptr<UcxConnection>> conns;
  {
    std::lock_guard<std::mutex> lock(mutex);
    tasks.swap(deferred);
    conns.swap(dirty);
  }
  for (auto& t : tasks) t();
  for (auto& c : conns) c->drain();
}

}  // namespace moolib

#endif
