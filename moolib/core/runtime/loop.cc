#include "runtime/loop.h"

#include <poll.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "runtime/error.h"
#include "runtime/logging.h"

namespace moolib {

namespace {

constexpr uint64_t kTaskToken = 1;
constexpr uint64_t kTimerToken = 2;
// A worker runs requests it read itself for this long before handing the rest
// to other workers.
constexpr auto kInlineBudget = std::chrono::milliseconds(2);
constexpr auto kRescueInterval = std::chrono::milliseconds(20);
// How long a worker keeps serving a connection it took requests from, waiting
// on the socket itself: the peer's next request then wakes it directly (a
// same-CPU "sync" wake-up) instead of an epoll waiter on another CPU.
constexpr auto kStickyWindow = std::chrono::milliseconds(20);
// Workers that may be blocked in waits at once, beyond max threads: each is
// replaced by a spare, so this bounds the threads nested calls can make.
constexpr int kMaxBlockedWorkers = 1024;
// Once no worker has blocked in a wait for this long, spares beyond max
// threads runnable workers end; long enough that a steady stream of nested
// calls keeps its spares instead of starting a thread per call. Not the
// spare's own idle time: the most recent epoll waiter is woken first, so one
// spare can get every timer and keepalive and never be idle.
constexpr auto kSpareLinger = std::chrono::seconds(5);

std::mutex gLoopMutex;
// Leaked on purpose: threads may outlive static destruction.
std::atomic<Loop*> gLoop{nullptr};
std::atomic<uint64_t> gGeneration{0};

void atforkPrepare() { gLoopMutex.lock(); }
void atforkParent() { gLoopMutex.unlock(); }
void atforkChild() {
  gLoopMutex.unlock();
  // The parent's threads do not exist here: abandon its loop (never touch its
  // mutexes, which another thread may have held at fork time).
  gLoop.store(nullptr);
  gGeneration.fetch_add(1);
}

int defaultThreads() {
  if (const char* env = std::getenv("MOOLIB_MAX_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  // Generous: a function that blocks in a nested call holds its thread.
  return std::max(16u, std::thread::hardware_concurrency() * 2);
}

// Set on workers while they handle I/O: requests read then run here.
thread_local bool tlsWorker = false;
thread_local InlineBatch* tlsInline = nullptr;
// A worker's own batch, for its whole life.
thread_local InlineBatch* tlsBatch = nullptr;
thread_local std::weak_ptr<FdHandler> tlsSticky;
// The batch whose task runs on this thread, while its replies are corked.
thread_local InlineBatch* tlsCorked = nullptr;
// The batch whose task runs on this thread (corked or not).
thread_local InlineBatch* tlsRunning = nullptr;
// Inside a BlockingRegion that counts this worker as blocked.
thread_local bool tlsBlocked = false;

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

}  // namespace

// The requests a worker read and runs itself (see Loop::runInline). The rescue
// thread takes the rest of a batch whose task runs too long (blocks, say)
// and flushes its corked replies, hence the lock.
struct InlineBatch {
  std::mutex mutex;
  std::deque<Task> tasks;
  bool corking = false;
  std::vector<std::shared_ptr<Corkable>> corked;
  std::atomic<int64_t> taskStartNs{0};  // when the running task began; 0: none runs
  std::shared_ptr<FdHandler> lent;      // see Loop::runInlineTasks
};

namespace {

size_t queuedIn(InlineBatch& batch) {
  std::lock_guard<std::mutex> lock(batch.mutex);
  return batch.tasks.size();
}

}  // namespace

BlockingRegion::BlockingRegion() {
  if (!tlsWorker || tlsBlocked) return;
  Loop* loop = gLoop.load(std::memory_order_acquire);
  if (!loop) return;
  loop->beginBlocking();
  counted_ = true;
}

BlockingRegion::~BlockingRegion() {
  if (!counted_) return;
  // The loop is never freed (a fork abandons it, leaked), so it is still there.
  if (Loop* loop = gLoop.load(std::memory_order_acquire)) loop->endBlocking();
  tlsBlocked = false;
}

bool corkIfBatching(const std::shared_ptr<Corkable>& c) {
  if (!tlsCorked) return false;
  std::lock_guard<std::mutex> lock(tlsCorked->mutex);
  if (!tlsCorked->corking) return false;  // the rescue thread uncorked the batch
  auto& corked = tlsCorked->corked;
  if (std::find(corked.begin(), corked.end(), c) == corked.end()) corked.push_back(c);
  return true;
}

Waiter::Waiter() {
  fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  MOO_ENFORCE(fd_ >= 0, "eventfd: ", std::strerror(errno));
}

Waiter::~Waiter() { ::close(fd_); }

void Waiter::notify() {
  uint64_t one = 1;
  ssize_t r = ::write(fd_, &one, sizeof(one));
  (void)r;
}

void Waiter::clear() {
  uint64_t value;
  ssize_t r = ::read(fd_, &value, sizeof(value));
  (void)r;
}

void Waiter::sleepUntil(TimePoint deadline) {
  pollfd p{fd_, POLLIN, 0};
  int r = ::poll(&p, 1, timeoutMs(deadline));
  if (r > 0) clear();
}

namespace {
thread_local std::unique_ptr<Waiter> tlsWaiter;
}  // namespace

Waiter& currentWaiter() {
  if (!tlsWaiter) tlsWaiter = std::make_unique<Waiter>();
  return *tlsWaiter;
}

Waiter* existingWaiter() { return tlsWaiter.get(); }

int timeoutMs(TimePoint deadline) {
  if (deadline == kForever) return -1;
  auto left =
      std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return int(std::min<int64_t>((left + 999) / 1000, 3600 * 1000));
}

Loop& Loop::instance() {
  static bool atforkInstalled = [] {
    pthread_atfork(atforkPrepare, atforkParent, atforkChild);
    return true;
  }();
  (void)atforkInstalled;
  if (Loop* loop = gLoop.load(std::memory_order_acquire)) return *loop;
  std::lock_guard<std::mutex> lock(gLoopMutex);
  if (!gLoop.load()) gLoop.store(new Loop());
  return *gLoop.load();
}

uint64_t Loop::generation() { return gGeneration.load(); }

Loop::Loop() : maxThreads_(defaultThreads()) {
  epollFd_ = epoll_create1(EPOLL_CLOEXEC);
  MOO_ENFORCE(epollFd_ >= 0, "epoll_create1: ", std::strerror(errno));
  taskFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC | EFD_SEMAPHORE);
  MOO_ENFORCE(taskFd_ >= 0, "eventfd: ", std::strerror(errno));
  timerFd_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  MOO_ENFORCE(timerFd_ >= 0, "timerfd_create: ", std::strerror(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kTaskToken;
  MOO_ENFORCE(epoll_ctl(epollFd_, EPOLL_CTL_ADD, taskFd_, &ev) == 0,
              "epoll_ctl: ", std::strerror(errno));
  ev.events = EPOLLIN | EPOLLONESHOT;
  ev.data.u64 = kTimerToken;
  MOO_ENFORCE(epoll_ctl(epollFd_, EPOLL_CTL_ADD, timerFd_, &ev) == 0,
              "epoll_ctl: ", std::strerror(errno));
  std::thread([this] { rescueMain(); }).detach();
  setMaxThreads(maxThreads_);
}

Loop::~Loop() {
  ::close(epollFd_);
  ::close(taskFd_);
  ::close(timerFd_);
}

void Loop::setMaxThreads(int n) {
  MOO_ENFORCE(n >= 1, "max threads must be at least 1, got ", n);
  std::unique_lock<std::mutex> lock(mutex_);
  maxThreads_ = n;
  // Indices, not a count: the threads a smaller pool ended leave when they
  // next wake up, in any order, and may still be there.
  if (workerLive_.size() < size_t(n)) workerLive_.resize(n, false);
  for (int index = 0; index < n && !stopping_; ++index) {
    if (workerLive_[index]) continue;
    workerLive_[index] = true;
    ++liveWorkers_;
    ++startingWorkers_;
    std::thread([this, index] { workerMain(index); }).detach();
  }
  workersStarted_.wait(lock, [this] { return startingWorkers_ == 0; });
}

void Loop::beginBlocking() {
  tlsBlocked = true;
  // The requests read with the one that now blocks, and the replies made to
  // those before it, go to the pool now: the reply this worker waits for may
  // depend on them.
  if (InlineBatch* batch = tlsRunning) {
    std::vector<std::shared_ptr<Corkable>> corked;
    std::shared_ptr<FdHandler> lent;
    {
      std::lock_guard<std::mutex> batchLock(batch->mutex);
      enqueue(batch->tasks);
      batch->corking = false;
      corked.swap(batch->corked);
      lent.swap(batch->lent);
    }
    for (auto& c : corked) c->uncork();
    if (lent) lent->takeBack();
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++blockedWorkers_;
    lastBlocked_ = Clock::now();
    if (stopping_ || liveWorkers_ - blockedWorkers_ >= maxThreads_) return;
    if (blockedWorkers_ > kMaxBlockedWorkers) {
      if (!warnedBlockedLimit_) {
        warnedBlockedLimit_ = true;
        MOO_LOG(kError, "more than ", kMaxBlockedWorkers,
                " core threads are blocked waiting for calls (nested sync() calls); no more "
                "are started in their place, so the calls they wait for may stall");
      }
      return;
    }
    // Counted now, so that workers blocking at the same time start one each.
    ++liveWorkers_;
  }
  try {
    std::thread([this] { workerMain(-1); }).detach();
  } catch (const std::system_error& e) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --liveWorkers_;
    }
    MOO_LOG(kError, "could not start a core thread in place of one blocked in a wait: ", e.what());
  }
}

void Loop::endBlocking() {
  std::lock_guard<std::mutex> lock(mutex_);
  --blockedWorkers_;
}

void Loop::shutdown(std::chrono::milliseconds grace) {
  if (stopping_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.clear();
  }
  // Wake every worker out of epoll_wait.
  uint64_t many = 1 << 20;
  ssize_t r = ::write(taskFd_, &many, sizeof(many));
  (void)r;
  TimePoint deadline = Clock::now() + grace;
  while (Clock::now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (liveWorkers_ == 0) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // Threads still inside user callbacks are left to finish on their own.
}

uint64_t Loop::addFd(int fd, uint32_t events, std::weak_ptr<FdHandler> handler) {
  uint64_t token;
  {
    std::lock_guard<std::mutex> lock(fdMutex_);
    token = nextFdToken_++;
    fds_[token] = FdEntry{fd, std::move(handler)};
  }
  epoll_event ev{};
  ev.events = events | EPOLLONESHOT;
  ev.data.u64 = token;
  if (epoll_ctl(epollFd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    std::lock_guard<std::mutex> lock(fdMutex_);
    fds_.erase(token);
    throw Exception(concat("epoll_ctl add: ", std::strerror(errno)));
  }
  return token;
}

void Loop::rearm(int fd, uint64_t token, uint32_t events) {
  epoll_event ev{};
  ev.events = events ? (events | EPOLLONESHOT) : 0;
  ev.data.u64 = token;
  epoll_ctl(epollFd_, EPOLL_CTL_MOD, fd, &ev);
}

void Loop::removeFd(int fd, uint64_t token) {
  epoll_ctl(epollFd_, EPOLL_CTL_DEL, fd, nullptr);
  std::lock_guard<std::mutex> lock(fdMutex_);
  fds_.erase(token);
}

void Loop::schedule(Task task) {
  if (stopping_) return;
  if (tlsInline) {
    std::lock_guard<std::mutex> lock(tlsInline->mutex);
    tlsInline->tasks.push_back(std::move(task));
    return;
  }
  pushShared(1, [&task](std::deque<Task>& shared) { shared.push_back(std::move(task)); });
}

void Loop::enqueue(std::deque<Task>& tasks) {
  if (tasks.empty()) return;
  pushShared(tasks.size(), [&tasks](std::deque<Task>& shared) {
    for (auto& t : tasks) shared.push_back(std::move(t));
  });
  tasks.clear();
}

template <typename Push>
void Loop::pushShared(uint64_t n, Push&& push) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    push(tasks_);
    queued_.fetch_add(int(n));
    // Workers serving a connection by themselves do not see the task fd.
    if (idleWorkers_.load() == 0) {
      for (Waiter* w : stickyWorkers_) w->notify();
    }
  }
  ssize_t r = ::write(taskFd_, &n, sizeof(n));
  (void)r;
}

bool Loop::hasInlineTasks() { return tlsInline && queuedIn(*tlsInline) > 0; }

bool Loop::onWorkerThread() { return tlsWorker; }

void Loop::runInlineTasks(const std::shared_ptr<FdHandler>& lent) {
  if (!tlsInline) return;
  InlineBatch& batch = *tlsInline;
  if (lent) {
    std::lock_guard<std::mutex> lock(batch.mutex);
    batch.lent = lent;
  }
  struct Unlend {
    InlineBatch& batch;
    ~Unlend() {
      std::lock_guard<std::mutex> lock(batch.mutex);
      batch.lent.reset();
    }
  } unlend{batch};
  runInline();
}

bool Loop::popTask(Task& out) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (tasks_.empty()) return false;
  out = std::move(tasks_.front());
  tasks_.pop_front();
  queued_.fetch_sub(1);
  return true;
}

uint64_t Loop::addTimer(TimePoint when, Task task) {
  std::lock_guard<std::mutex> lock(timerMutex_);
  uint64_t id = nextTimerId_++;
  timerHeap_.push_back(Timer{when, id});
  std::push_heap(timerHeap_.begin(), timerHeap_.end(), std::greater<Timer>());
  timerTasks_[id] = std::move(task);
  if (when < timerFdDue_) armTimerFdLocked();
  return id;
}

void Loop::cancelTimer(uint64_t id) {
  std::lock_guard<std::mutex> lock(timerMutex_);
  timerTasks_.erase(id);  // the heap entry is skipped when it comes due
}

void Loop::armTimerFdLocked() {
  while (!timerHeap_.empty() && !timerTasks_.count(timerHeap_.front().id)) {
    std::pop_heap(timerHeap_.begin(), timerHeap_.end(), std::greater<Timer>());
    timerHeap_.pop_back();
  }
  itimerspec spec{};
  if (timerHeap_.empty()) {
    timerFdDue_ = kForever;
  } else {
    timerFdDue_ = timerHeap_.front().when;
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timerFdDue_.time_since_epoch())
                  .count();
    ns = std::max<int64_t>(ns, 1);
    spec.it_value.tv_sec = ns / 1000000000;
    spec.it_value.tv_nsec = ns % 1000000000;
  }
  timerfd_settime(timerFd_, TFD_TIMER_ABSTIME, &spec, nullptr);
}

void Loop::runTimers() {
  uint64_t expirations;
  ssize_t r = ::read(timerFd_, &expirations, sizeof(expirations));
  (void)r;
  while (true) {
    Task task;
    {
      std::lock_guard<std::mutex> lock(timerMutex_);
      if (timerHeap_.empty() || timerHeap_.front().when > Clock::now()) {
        armTimerFdLocked();
        break;
      }
      Timer top = timerHeap_.front();
      std::pop_heap(timerHeap_.begin(), timerHeap_.end(), std::greater<Timer>());
      timerHeap_.pop_back();
      auto it = timerTasks_.find(top.id);
      if (it == timerTasks_.end()) continue;
      task = std::move(it->second);
      timerTasks_.erase(it);
    }
    task();
  }
  rearm(timerFd_, kTimerToken, EPOLLIN);
}

std::shared_ptr<FdHandler> Loop::dispatch(uint64_t token, uint32_t events) {
  if (token == kTimerToken) {
    runTimers();
    return nullptr;
  }
  std::shared_ptr<FdHandler> handler;
  {
    std::lock_guard<std::mutex> lock(fdMutex_);
    auto it = fds_.find(token);
    if (it != fds_.end()) handler = it->second.handler.lock();
  }
  if (handler) handler->onEvents(events);
  return handler;
}

void Loop::runInline() {
  InlineBatch& batch = *tlsInline;
  {
    std::lock_guard<std::mutex> lock(batch.mutex);
    if (batch.tasks.empty()) return;
    batch.corking = batch.tasks.size() > 1;
  }
  // Only a batch that corks is seen by its tasks' sends: a lone request's
  // reply goes out with no lock taken.
  InlineBatch* corkable = batch.corking ? &batch : nullptr;
  struct Uncork {
    InlineBatch& batch;
    ~Uncork() {
      std::vector<std::shared_ptr<Corkable>> corked;
      {
        std::lock_guard<std::mutex> lock(batch.mutex);
        batch.corking = false;
        corked.swap(batch.corked);
      }
      for (auto& c : corked) c->uncork();
    }
  } uncork{batch};
  TimePoint start = Clock::now();
  while (true) {
    Task t;
    std::shared_ptr<FdHandler> lent;
    {
      std::lock_guard<std::mutex> lock(batch.mutex);
      if (batch.tasks.empty()) break;
      bool overBudget = Clock::now() - start > kInlineBudget;
      // Long-running work: the loop serves the lent fd meanwhile...
      if (overBudget) lent.swap(batch.lent);
      if (overBudget && batch.tasks.size() > 1) {
        // ...and idle workers take the rest.
        enqueue(batch.tasks);
      } else {
        t = std::move(batch.tasks.front());
        batch.tasks.pop_front();
        batch.taskStartNs = nowNs();
      }
    }
    if (lent) lent->takeBack();
    if (!t) break;
    tlsInline = nullptr;  // what this task schedules goes to the shared queue
    tlsCorked = corkable;
    tlsRunning = &batch;
    t();
    tlsRunning = nullptr;
    tlsCorked = nullptr;
    tlsInline = &batch;
    batch.taskStartNs = 0;
  }
}

void Loop::rescueStuckBatches() {
  // A task that blocks (a function waiting for another call, say) must not
  // hold up the requests read with it, nor the replies already corked.
  int64_t stuckSince = nowNs() - std::chrono::nanoseconds(kInlineBudget).count();
  std::vector<std::shared_ptr<Corkable>> corked;
  std::vector<std::shared_ptr<FdHandler>> lent;
  {
    std::lock_guard<std::mutex> lock(batchesMutex_);
    for (InlineBatch* batch : batches_) {
      int64_t started = batch->taskStartNs.load();
      if (started == 0 || started > stuckSince) continue;
      std::lock_guard<std::mutex> batchLock(batch->mutex);
      enqueue(batch->tasks);
      batch->corking = false;
      for (auto& c : batch->corked) corked.push_back(std::move(c));
      batch->corked.clear();
      if (batch->lent) lent.push_back(std::move(batch->lent));
    }
  }
  for (auto& c : corked) c->uncork();
  for (auto& h : lent) h->takeBack();
}

int Loop::pollRound(int timeout, bool worker) {
  epoll_event events[16];
  if (worker) idleWorkers_.fetch_add(1);
  int n = epoll_wait(epollFd_, events, worker ? 4 : 16, timeout);
  if (worker) idleWorkers_.fetch_sub(1);
  InlineBatch* batch = worker ? tlsBatch : nullptr;
  tlsInline = batch;
  bool taskSignal = false;
  for (int i = 0; i < n; ++i) {
    if (events[i].data.u64 == kTaskToken) {
      taskSignal = true;
      continue;
    }
    size_t before = batch ? queuedIn(*batch) : 0;
    auto handler = dispatch(events[i].data.u64, events[i].events);
    if (batch && handler && queuedIn(*batch) > before) tlsSticky = handler;
  }
  if (worker) {
    runInline();
    tlsInline = nullptr;
    if (taskSignal) {
      uint64_t value;
      if (::read(taskFd_, &value, sizeof(value)) > 0) {
        Task t;
        if (popTask(t)) t();
      }
    }
  }
  return n;
}

bool Loop::tryCreateWaiter(int index, bool firstTry) {
  try {
    currentWaiter();
    if (!firstTry) MOO_LOG(kInfo, "worker thread ", index, " got its descriptor and starts");
    return true;
  } catch (const Exception& e) {
    if (firstTry) {
      MOO_LOG(kError, "worker thread ", index, ": ", e.what(),
              "; it starts once a descriptor is free");
    }
    return false;
  }
}

void Loop::workerMain(int index) {
  tlsWorker = true;
  // Its eventfd now, not at some later first wait, and setMaxThreads() waits
  // for that: once an Rpc exists, its process has all its descriptors open.
  // Without a descriptor left (a flood of connections can use them all up) the
  // worker waits for one: an exception escaping a thread would end the process.
  bool spare = index < 0;
  bool ready = tryCreateWaiter(index, true);
  if (!spare) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --startingWorkers_;
    }
    workersStarted_.notify_all();
  }
  while (!ready && !stopping_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ready = tryCreateWaiter(index, false);
  }
  auto batch = std::make_unique<InlineBatch>();
  tlsBatch = batch.get();
  {
    std::lock_guard<std::mutex> lock(batchesMutex_);
    batches_.push_back(tlsBatch);
  }
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Decided and recorded at once, so setMaxThreads never counts on a
      // worker that is leaving.
      if (stopping_ || (!spare && index >= maxThreads_)) {
        if (!spare) workerLive_[index] = false;
        break;
      }
    }
    if (auto sticky = tlsSticky.lock()) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        stickyWorkers_.push_back(&currentWaiter());
      }
      tlsInline = tlsBatch;
      bool active = sticky->serveSticky(Clock::now() + kStickyWindow);
      runInline();
      tlsInline = nullptr;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        stickyWorkers_.erase(
            std::find(stickyWorkers_.begin(), stickyWorkers_.end(), &currentWaiter()));
      }
      if (!active) tlsSticky.reset();
      Task t;
      if (popTask(t)) t();
      continue;
    }
    if (!spare) {
      pollRound(-1, true);
      continue;
    }
    pollRound(timeoutMs(Clock::now() + kSpareLinger), true);
    std::lock_guard<std::mutex> lock(mutex_);
    // The workers it stood in for are running again (or gone).
    if (liveWorkers_ - blockedWorkers_ > maxThreads_ &&
        Clock::now() - lastBlocked_ >= kSpareLinger) {
      break;
    }
  }
  tlsSticky.reset();
  {
    std::lock_guard<std::mutex> lock(batchesMutex_);
    batches_.erase(std::find(batches_.begin(), batches_.end(), tlsBatch));
  }
  tlsBatch = nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  --liveWorkers_;
}

void Loop::rescueMain() {
  // Only polls while no worker is waiting for events, i.e. all are busy.
  while (!stopping_) {
    std::this_thread::sleep_for(kRescueInterval);
    if (stopping_) break;
    if (idleWorkers_.load() == 0) pollRound(0, false);
    rescueStuckBatches();
  }
}

}  // namespace moolib
