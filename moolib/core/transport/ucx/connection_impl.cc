#include "transport/ucx/connection_impl.h"

#if MOOLIB_UCX_HEADERS

#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "logging.h"
#include "spin.h"
#include "transport/stream_connection.h"

namespace moolib {

namespace {

constexpr uint8_t kPreamble = 0x4d;  // 'M': the accepting side is wired up
// Segments up to this size are copied behind the head: one send is cheaper
// than two for them.
constexpr size_t kCopyBelow = 16 << 10;
constexpr auto kPollInterval = std::chrono::milliseconds(1);
// A segment this large coming in over UCX's TCP is polled for, not slept on:
// each wake-up on the event fd brings in about a socket buffer's worth, and
// waking costs about as much as reading it
// (docs/decisions/ucx-bulk-polling.md). The poll stops once nothing came for
// kBulkQuiet (the sender stalled). Not over shared memory, where the poller
// takes the core the copy needs.
constexpr size_t kBulkBytes = size_t(1) << 20;
constexpr auto kBulkQuiet = std::chrono::milliseconds(2);

}  // namespace

// ---------------------------------------------------------------------------
// UcxRuntime

const UcxProbe& UcxProbe::get() {
  static const UcxProbe probe = [] {
    UcxProbe p;
    if (const char* off = std::getenv("MOOLIB_UCX"); off && std::string(off) == "0") {
      p.whyNot = "turned off by MOOLIB_UCX=0";
      return p;
    }
    // UCX installs handlers for SIGSEGV, SIGBUS, ... when loaded unless told
    // otherwise; they would replace Python's (faulthandler). And it takes
    // SIGHUP (UCX_DEBUG_SIGNO) to print debug information: a launcher whose
    // terminal went away would go on running. A value the user set is kept.
    ::setenv("UCX_HANDLE_ERRORS", "none", 0);
    ::setenv("UCX_DEBUG_SIGNO", "0", 0);
    p.api = loadUcx(p.whyNot);
    if (!p.api) return p;
    const UcxApi* api = p.api;
    // UCX's transports and devices here (uct), and whether one of them is an
    // RDMA network: a network transport other than TCP.
    std::string devices;
    uct_component_h* components = nullptr;
    unsigned numComponents = 0;
    if (api->uct_query_components(&components, &numComponents) == UCS_OK) {
      for (unsigned i = 0; i != numComponents; ++i) {
        uct_component_attr_t attr{};
        attr.field_mask =
            UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
        if (api->uct_component_query(components[i], &attr) != UCS_OK) continue;
        std::vector<uct_md_resource_desc_t> mds(attr.md_resource_count);
        attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
        attr.md_resources = mds.data();
        if (mds.empty() || api->uct_component_query(components[i], &attr) != UCS_OK) continue;
        for (auto& md : mds) {
          uct_md_config_t* mdConfig = nullptr;
          if (api->uct_md_config_read(components[i], nullptr, nullptr, &mdConfig) != UCS_OK)
            continue;
          uct_md_h handle = nullptr;
          ucs_status_t st = api->uct_md_open(components[i], md.md_name, mdConfig, &handle);
          api->uct_config_release(mdConfig);
          if (st != UCS_OK) continue;
          uct_tl_resource_desc_t* tls = nullptr;
          unsigned numTls = 0;
          if (api->uct_md_query_tl_resources(handle, &tls, &numTls) == UCS_OK) {
            for (unsigned t = 0; t != numTls; ++t) {
              std::string tl = tls[t].tl_name;
              if (tls[t].dev_type == UCT_DEVICE_TYPE_NET && tl != "tcp") p.rdma = true;
              std::string item = tl + "/" + tls[t].dev_name;
              if (devices.size() + item.size() < 900) {
                devices += (devices.empty() ? "" : ",") + item;
              }
            }
            api->uct_release_tl_resource_list(tls);
          }
          api->uct_md_close(handle);
        }
      }
      api->uct_release_component_list(components);
    }
    // UCX_TLS may leave the RDMA transports out.
    if (const char* tls = std::getenv("UCX_TLS")) {
      std::string v = tls;
      bool mayUseRdma = v.empty() || v[0] == '^' || v.find("all") != std::string::npos;
      for (const char* t : {"rc", "ud", "dc", "ib"}) mayUseRdma |= v.find(t) != std::string::npos;
      if (!mayUseRdma) p.rdma = false;
    }
    // For tests of the choice on machines without RDMA: count UCX's devices
    // here as RDMA-capable.
    if (const char* v = std::getenv("MOOLIB_UCX_ASSUME_RDMA"); v && std::string(v) == "1") {
      p.rdma = true;
    }
    p.domain = concat("rdma=", p.rdma ? 1 : 0, ";", devices);
    return p;
  }();
  return probe;
}

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

bool UcxConnection::serveWhile(const std::function<bool()>& done, TimePoint deadline,
                               bool claimed) {
  flush();  // the call this thread waits for may be in a held-back burst
  if (!claimed && (closed_ || !rt_->claim())) return false;
  rt_->serve([&] { return done() || closed_.load(); }, deadline);
  rt_->unown();
  return true;
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

// ---------------------------------------------------------------------------
// UcxConnection

namespace {

void recvCallback(void* request, ucs_status_t status, size_t length, void* user) {
  static_cast<UcxConnection*>(user)->onRecvDone(request, status, length);
}

void closeCallback(void* request, ucs_status_t status, void* user) {
  static_cast<UcxConnection*>(user)->onCloseDone(request);
}

}  // namespace

void UcxConnection::sendCallback(void* request, ucs_status_t status, void* user) {
  auto* tag = static_cast<SendTag*>(user);
  tag->conn->onSendDone(request, status, tag->op);
}

UcxConnection::UcxConnection(std::shared_ptr<UcxRuntime> runtime, std::string local,
                             std::string remote)
    : rt_(std::move(runtime)), local_(std::move(local)), remote_(std::move(remote)) {}

UcxConnection::~UcxConnection() = default;

std::string UcxConnection::statusString(ucs_status_t s) const {
  return rt_->api.ucs_status_string(s);
}

void UcxConnection::dialLocked(ucp_ep_h ep, Context::ConnectFn done) {
  ep_ = ep;
  connectDone_ = std::move(done);
  rt_->live.insert(shared_from_this());
  state_ = RecvState::kPreamble;
  pumpLocked();
}

void UcxConnection::acceptLocked(ucp_ep_h ep, Task wired) {
  ep_ = ep;
  rt_->live.insert(shared_from_this());
  // Handed up only once the preamble has left: until the dialer has
  // confirmed the connection, UCX queues sends, and UCX 1.13 replays them
  // over the final lanes with the message protocol picked for the first
  // ones: a frame of 93-128 bytes then fails on its shared memory ("Invalid
  // am_short length"). The preamble, 1 byte, fits any.
  acceptDone_ = std::move(wired);
  static const uint8_t preamble = kPreamble;
  SendOp& op = sends_[0];
  op.tag = SendTag{this, 0};
  if (!postLocked(op, &preamble, 1)) {
    sends_.erase(0);
  } else if (op.pending) {
    rt_->ensurePollingLocked();
  } else {
    sends_.erase(0);
    wiredLocked();
  }
}

void UcxConnection::wiredLocked() {
  if (!acceptDone_ || closed_) return;
  readLanesLocked();
  rt_->deferred.push_back(std::move(acceptDone_));
  acceptDone_ = nullptr;
}

void UcxConnection::readLanesLocked() {
  // ucp_ep_print_info writes lines such as
  //   "#   lane[1]:  2:sysv/memory.0 md[1]  -> md[1]/sysv/sysdev[255] am am_bw#0"
  // the transport/device of each lane (the connection manager's lane has none).
  char* text = nullptr;
  size_t size = 0;
  FILE* out = ::open_memstream(&text, &size);
  if (!out) return;
  rt_->api.ucp_ep_print_info(ep_, out);
  ::fclose(out);
  std::istringstream all(std::string(text, size));
  ::free(text);
  std::string lanes, line;
  while (std::getline(all, line)) {
    size_t colon = line.find("]: ");  // "lane[1]: " then the lane's resource
    if (line.find("lane[") == std::string::npos || colon == std::string::npos) continue;
    std::string item;
    std::istringstream(line.substr(colon + 3)) >> item;
    size_t index = item.find(':');  // "2:sysv/memory.0": the resource's index first
    if (index == std::string::npos || item.find('/') == std::string::npos) continue;
    item = item.substr(index + 1);
    if (("," + lanes + ",").find("," + item + ",") == std::string::npos) {
      lanes += (lanes.empty() ? "" : ",") + item;
    }
  }
  lanes_ = lanes;
  tcpOnly_ = !lanes.empty();
  std::istringstream each(lanes);
  std::string lane;
  while (std::getline(each, lane, ',')) tcpOnly_ = tcpOnly_ && lane.rfind("tcp/", 0) == 0;
}

void UcxConnection::bulkLocked(bool on) {
  if (on == bulk_) return;
  bulk_ = on;
  if (on) {
    ++rt_->bulkReceives;
  } else {
    --rt_->bulkReceives;
  }
}

void UcxConnection::start(FrameFn onFrame, CloseFn onClose) {
  {
    std::lock_guard<std::mutex> lock(inboxMutex_);
    onFrame_ = std::move(onFrame);
    onClose_ = std::move(onClose);
  }
  {
    std::lock_guard<std::mutex> lock(rt_->mutex);
    started_ = true;
    if (!closed_ && state_ == RecvState::kIdle) {
      state_ = RecvState::kHeader;
      pumpLocked();
    }
    markDirtyLocked();
  }
  rt_->runDeferred();
}

void UcxConnection::send(OutgoingFrame&& frame) {
  if (closed_) return;
  QueuedFrame q;
  FrameHeader h{kFrameMagic,
                kWireVersion,
                uint8_t(frame.type),
                0,
                uint32_t(frame.segments.size()),
                uint32_t(frame.meta.size()),
                0};
  size_t copied = 0;
  for (auto& s : frame.segments) copied += s.size < kCopyBelow ? s.size : 0;
  q.head.reserve(sizeof(h) + frame.segments.size() * sizeof(SegmentDesc) + frame.meta.size() +
                 copied);
  q.head.append(reinterpret_cast<const char*>(&h), sizeof(h));
  for (auto& s : frame.segments) {
    SegmentDesc d{s.size, uint32_t(SegmentKind::kInline), 0, 0};
    q.head.append(reinterpret_cast<const char*>(&d), sizeof(d));
  }
  q.head.append(frame.meta);
  // Segments in order: the small ones copied behind the head until the first
  // large one; from there each goes out as its own send (the stream keeps
  // the order), the small ones after it too.
  size_t i = 0;
  for (; i != frame.segments.size() && frame.segments[i].size < kCopyBelow; ++i) {
    q.head.append(reinterpret_cast<const char*>(frame.segments[i].data), frame.segments[i].size);
  }
  for (; i != frame.segments.size(); ++i) {
    if (frame.segments[i].size) q.segments.push_back(std::move(frame.segments[i]));
  }
  uint64_t total = q.head.size();
  for (auto& s : q.segments) total += s.size;

  // Only replies are corked: a request a function sends must not wait for
  // the rest of its batch.
  bool corked = frame.type == FrameType::kResponse &&
                corkIfBatching(std::static_pointer_cast<Corkable>(shared_from_this()));
  SendOp finished;  // dropped after the lock, outside the mutex
  std::unique_lock<std::mutex> lock(rt_->mutex);
  if (closed_ || !ep_) return;
  bytesSent_ += total;
  queue_.push_back(std::move(q));
  if (corked) return;
  if (burst_.writeNow(queue_.size())) {
    bool ok = flushLocked(finished);
    lock.unlock();
    if (!ok) rt_->runDeferred();
    return;
  }
  if (!flushTimer_) {
    std::weak_ptr<UcxConnection> weak = shared_from_this();
    flushTimer_ = Loop::instance().addTimer(Clock::now() + SendBurst::kDelay, [weak] {
      if (auto self = weak.lock()) self->flush();
    });
  }
}

void UcxConnection::flush() {
  SendOp finished;
  bool ok;
  {
    std::lock_guard<std::mutex> lock(rt_->mutex);
    flushTimer_ = 0;  // a pending timer finds the queue empty
    ok = flushLocked(finished);
  }
  if (!ok) rt_->runDeferred();
}

bool UcxConnection::flushLocked(SendOp& finished) {
  if (queue_.empty() || closed_ || !ep_) return true;
  uint64_t id = nextSend_++;
  // A map node: its address (the requests' user data) is stable.
  SendOp& op = sends_[id];
  op.tag = SendTag{this, id};
  // The heads of consecutive frames are joined into one send, up to a frame
  // with large segments, which go out from the caller's memory after it.
  // Reserved (a frame at most opens one head): a head's bytes stay put once
  // posted. Taken out of queue_ first, as a failed post closes the
  // connection, which empties it.
  std::vector<QueuedFrame> queued;
  queued.swap(queue_);
  op.heads.reserve(queued.size());
  op.heads.emplace_back();
  bool ok = true;
  for (size_t k = 0; ok && k != queued.size(); ++k) {
    QueuedFrame& q = queued[k];
    std::string& head = op.heads.back();
    if (head.empty()) {
      head = std::move(q.head);  // a lone frame: no copy
    } else {
      head.append(q.head);
    }
    bool last = k + 1 == queued.size();
    if (q.segments.empty() && !last) continue;
    ok = postLocked(op, head.data(), head.size());
    for (size_t j = 0; ok && j != q.segments.size(); ++j) {
      ok = postLocked(op, q.segments[j].data, q.segments[j].size);
    }
    if (!last) op.heads.emplace_back();
  }
  // Kept alive until the sends are done, and after a failure dropped with op
  // (outside the mutex).
  takeSegments(queued, op.segments);
  // The queue's storage is kept for the next sends.
  queued.clear();
  if (queue_.empty()) queue_.swap(queued);
  auto it = sends_.find(id);  // a failure above may have cleared them all
  if (it != sends_.end() && it->second.pending == 0) {
    finished = std::move(it->second);
    sends_.erase(it);
  } else if (it != sends_.end()) {
    rt_->ensurePollingLocked();
  }
  return ok;
}

void UcxConnection::takeSegments(std::vector<QueuedFrame>& from, std::vector<OutSegment>& to) {
  for (auto& q : from) {
    for (auto& seg : q.segments) to.push_back(std::move(seg));
  }
}

bool UcxConnection::postLocked(SendOp& op, const void* data, size_t size) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &UcxConnection::sendCallback;
  p.user_data = &op.tag;
  ucs_status_ptr_t r = rt_->api.ucp_stream_send_nbx(ep_, data, size, &p);
  if (UCS_PTR_IS_ERR(r)) {
    failLocked(concat("UCX send: ", statusString(UCS_PTR_STATUS(r))));
    return false;
  }
  if (r) {
    op.pending++;
    rt_->sendsInFlight++;
  }
  return true;
}

void UcxConnection::sendRaw(std::string bytes) {
  SendOp finished;
  std::lock_guard<std::mutex> lock(rt_->mutex);
  if (!flushLocked(finished) || closed_ || !ep_) return;
  uint64_t id = nextSend_++;
  SendOp& op = sends_[id];
  op.tag = SendTag{this, id};
  op.heads.push_back(std::move(bytes));
  if (postLocked(op, op.heads.back().data(), op.heads.back().size()) && op.pending) {
    rt_->ensurePollingLocked();
  } else if (sends_.count(id)) {
    sends_.erase(id);
  }
}

void UcxConnection::onSendDone(void* request, ucs_status_t status, uint64_t op) {
  rt_->api.ucp_request_free(request);
  rt_->sendsInFlight--;
  auto it = sends_.find(op);
  if (it != sends_.end() && --it->second.pending == 0) {
    // Dropped outside the mutex: a segment's keepalive may be a tensor.
    auto done = std::make_shared<SendOp>(std::move(it->second));
    sends_.erase(it);
    rt_->deferred.push_back([done] {});
  }
  if (status != UCS_OK && status != UCS_ERR_CANCELED) {
    failLocked(concat("UCX send failed: ", statusString(status)));
  } else if (op == 0) {
    wiredLocked();
  }
  maybeRetireLocked();
}

void UcxConnection::pumpLocked() {
  while (!closed_ && !recvPending_ && ep_) {
    void* target = nullptr;
    size_t size = 0;
    switch (state_) {
      case RecvState::kIdle:
      case RecvState::kHeld:
        return;
      case RecvState::kPreamble:
        target = &preamble_;
        size = 1;
        break;
      case RecvState::kHeader:
        target = &header_;
        size = sizeof(header_);
        break;
      case RecvState::kFixed:
        target = fixed_.data();
        size = fixed_.size();
        break;
      case RecvState::kSegment:
        target = frame_.segments[segmentIndex_]->data();
        size = frame_.segments[segmentIndex_]->size();
        break;
    }
    if (size == 0) {
      if (!advanceLocked(0)) return;
      continue;
    }
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.recv_stream = &recvCallback;
    p.user_data = this;
    p.flags = UCP_STREAM_RECV_FLAG_WAITALL;
    size_t length = 0;
    ucs_status_ptr_t r = rt_->api.ucp_stream_recv_nbx(ep_, target, size, &length, &p);
    if (UCS_PTR_IS_ERR(r)) {
      failLocked(concat("UCX receive: ", statusString(UCS_PTR_STATUS(r))));
      return;
    }
    if (r) {
      recvPending_ = true;
      recvRequest_ = r;
      return;
    }
    if (!advanceLocked(length)) return;
  }
}

void UcxConnection::onRecvDone(void* request, ucs_status_t status, size_t length) {
  rt_->api.ucp_request_free(request);
  recvPending_ = false;
  recvRequest_ = nullptr;
  if (status != UCS_OK) {
    if (status != UCS_ERR_CANCELED) {
      failLocked(concat("UCX receive failed: ", statusString(status)));
    }
    maybeRetireLocked();
    return;
  }
  if (advanceLocked(length)) pumpLocked();
  maybeRetireLocked();
}

bool UcxConnection::advanceLocked(size_t length) {
  bytesReceived_ += length;
  try {
    switch (state_) {
      case RecvState::kIdle:
      case RecvState::kHeld:
        return true;
      case RecvState::kPreamble: {
        if (preamble_ != kPreamble) {
          failLocked("the peer is not a moolib UCX endpoint");
          return false;
        }
        state_ = RecvState::kIdle;
        if (connectDone_) {
          readLanesLocked();
          if (connectTimer_) Loop::instance().cancelTimer(connectTimer_);
          connectTimer_ = 0;
          auto done = std::move(connectDone_);
          connectDone_ = nullptr;
          auto self = shared_from_this();
          rt_->deferred.push_back([done, self] { done(Error(), self); });
        }
        return true;
      }
      case RecvState::kHeader: {
        if (Error e = validateHeader(header_, handshaken_)) {
          failLocked(e.what());
          return false;
        }
        // Bounded by the header's checks: kMaxSegments descriptors, kMaxMetaLength.
        fixed_.resize(size_t(header_.numSegments) * sizeof(SegmentDesc) + header_.metaLength);
        state_ = RecvState::kFixed;
        return true;
      }
      case RecvState::kFixed: {
        descs_.resize(header_.numSegments);
        std::memcpy(descs_.data(), fixed_.data(), descs_.size() * sizeof(SegmentDesc));
        uint64_t limit =
            handshaken_ ? StreamConnection::kMaxMessageBytes : uint64_t(kMaxHandshakeFrame);
        uint64_t total = 0;
        for (auto& d : descs_) {
          if (d.kind != uint32_t(SegmentKind::kInline)) {
            failLocked(concat("segment kind ", d.kind, " over UCX (only inline segments)"));
            return false;
          }
          if (d.length > limit || total + d.length > limit) {
            failLocked(concat("frame of more than ", limit, " bytes"));
            return false;
          }
          total += d.length;
        }
        frame_.type = FrameType(header_.type);
        frame_.meta.assign(
            reinterpret_cast<const char*>(fixed_.data()) + descs_.size() * sizeof(SegmentDesc),
            header_.metaLength);
        frame_.segments.clear();
        frame_.segments.reserve(descs_.size());
        for (auto& d : descs_) frame_.segments.push_back(allocateBuffer(d.length));
        segmentIndex_ = 0;
        return nextSegmentLocked();
      }
      case RecvState::kSegment:
        ++segmentIndex_;
        return nextSegmentLocked();
    }
  } catch (const std::bad_alloc&) {
    failLocked("out of memory for an incoming frame");
    return false;
  }
  return true;
}

bool UcxConnection::nextSegmentLocked() {
  while (segmentIndex_ < frame_.segments.size() && frame_.segments[segmentIndex_]->size() == 0) {
    ++segmentIndex_;
  }
  if (segmentIndex_ < frame_.segments.size()) {
    state_ = RecvState::kSegment;
    bulkLocked(tcpOnly_ && frame_.segments[segmentIndex_]->size() >= kBulkBytes);
    return true;
  }
  bulkLocked(false);
  deliverLocked();
  state_ = handshaken_ ? RecvState::kHeader : RecvState::kHeld;
  return !closed_;
}

void UcxConnection::deliverLocked() {
  {
    std::lock_guard<std::mutex> lock(inboxMutex_);
    inbox_.push_back(std::move(frame_));
  }
  frame_ = IncomingFrame{};
  markDirtyLocked();
}

void UcxConnection::markDirtyLocked() {
  std::lock_guard<std::mutex> lock(inboxMutex_);
  if (dirty_ || (inbox_.empty() && !closeQueued_)) return;
  dirty_ = true;
  rt_->dirty.push_back(shared_from_this());
}

void UcxConnection::drain() {
  std::unique_lock<std::mutex> lock(inboxMutex_);
  dirty_ = false;
  if (draining_ || !onFrame_) return;
  draining_ = true;
  for (;;) {
    if (!inbox_.empty()) {
      IncomingFrame f = std::move(inbox_.front());
      inbox_.pop_front();
      if (closeDelivered_) continue;
      auto fn = onFrame_;
      lock.unlock();
      fn(std::move(f));
      resumeAfterHeld();
      lock.lock();
      continue;
    }
    if (closeQueued_ && !closeDelivered_) {
      closeDelivered_ = true;
      auto fn = std::move(onClose_);
      onClose_ = nullptr;
      onFrame_ = [](IncomingFrame&&) {};
      Error reason = closeReason_;
      lock.unlock();
      if (fn) fn(reason);
      lock.lock();
      continue;
    }
    break;
  }
  draining_ = false;
}

void UcxConnection::resumeAfterHeld() {
  {
    std::lock_guard<std::mutex> lock(rt_->mutex);
    if (state_ != RecvState::kHeld || closed_) return;
    state_ = RecvState::kHeader;
    pumpLocked();
  }
  // What the receives completed at once queued (this connection's frames are
  // handed up by the drain that called here).
  rt_->runDeferred();
}

void UcxConnection::close(const Error& reason) {
  {
    std::lock_guard<std::mutex> lock(rt_->mutex);
    closeLocked(reason, false);
  }
  rt_->runDeferred();
}

void UcxConnection::failLocked(const std::string& why) {
  if (closed_) return;
  MOO_LOG(kVerbose, "UCX connection ", remote_, ": ", why);
  closeLocked(Error(why), true);
}

void UcxConnection::closeLocked(const Error& reason, bool force) {
  if (closed_) return;
  // A graceful close sends what a burst held back first; a failed
  // connection drops it (outside the mutex: it may keep tensors alive).
  SendOp finished;
  if (!force) flushLocked(finished);
  takeSegments(queue_, finished.segments);
  queue_.clear();
  if (!finished.segments.empty()) {
    rt_->deferred.push_back([drop = std::make_shared<SendOp>(std::move(finished))] {});
  }
  // A failed flush closed the connection already.
  if (closed_.exchange(true)) return;
  bulkLocked(false);
  if (connectDone_) {
    // Still dialing: the dial fails.
    if (connectTimer_) Loop::instance().cancelTimer(connectTimer_);
    connectTimer_ = 0;
    auto done = std::move(connectDone_);
    connectDone_ = nullptr;
    rt_->deferred.push_back([done, reason] { done(reason, nullptr); });
  }
  // Never handed up; dropped outside the mutex (it holds this connection).
  if (acceptDone_) rt_->deferred.push_back([drop = std::move(acceptDone_)] {});
  acceptDone_ = nullptr;
  {
    std::lock_guard<std::mutex> lock(inboxMutex_);
    closeQueued_ = true;
    closeReason_ = reason;
  }
  if (started_) markDirtyLocked();
  if (recvPending_ && recvRequest_) rt_->api.ucp_request_cancel(rt_->worker, recvRequest_);
  if (ep_) {
    ucp_ep_h ep = ep_;
    ep_ = nullptr;
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = &closeCallback;
    p.user_data = this;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    closing_ = true;
    ucs_status_ptr_t r = rt_->api.ucp_ep_close_nbx(ep, &p);
    if (!UCS_PTR_IS_PTR(r)) closing_ = false;
  }
  maybeRetireLocked();
}

void UcxConnection::onCloseDone(void* request) {
  rt_->api.ucp_request_free(request);
  closing_ = false;
  maybeRetireLocked();
}

void UcxConnection::maybeRetireLocked() {
  // UCX holds raw pointers to this connection until its endpoint is closed
  // and its requests have called back.
  if (!closed_ || closing_ || recvPending_ || !sends_.empty()) return;
  auto self = shared_from_this();
  if (rt_->live.erase(self)) rt_->deferred.push_back([self] {});
}

}  // namespace moolib

#endif
