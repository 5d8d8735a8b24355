#include "loop.h"

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "error.h"
#include "logging.h"

namespace moolib {

namespace {

constexpr uint64_t kEventFdToken = 0;

std::mutex gLoopMutex;
Loop* gLoop = nullptr;  // leaked on purpose: threads may outlive static destruction
std::atomic<uint64_t> gGeneration{0};

void atforkPrepare() { gLoopMutex.lock(); }
void atforkParent() { gLoopMutex.unlock(); }
void atforkChild() {
  gLoopMutex.unlock();
  // The parent's threads do not exist here: abandon its loop (never touch its
  // mutexes, which another thread may have held at fork time).
  gLoop = nullptr;
  gGeneration.fetch_add(1);
}

int defaultThreads() {
  if (const char* env = std::getenv("MOOLIB_MAX_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  return std::max(4u, std::thread::hardware_concurrency() * 2);
}

thread_local Waiter tlsWaiter;
thread_local Loop* tlsPollingLoop = nullptr;

}  // namespace

Waiter& currentWaiter() { return tlsWaiter; }

void Waiter::notify() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    signaled_ = true;
  }
  cv_.notify_one();
  if (polling_.load()) Loop::instance().kick();
}

void Waiter::sleepUntil(TimePoint deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (deadline == kForever) {
    cv_.wait(lock, [&] { return signaled_; });
  } else {
    cv_.wait_until(lock, deadline, [&] { return signaled_; });
  }
  signaled_ = false;
}

Loop& Loop::instance() {
  static bool atforkInstalled = [] {
    pthread_atfork(atforkPrepare, atforkParent, atforkChild);
    return true;
  }();
  (void)atforkInstalled;
  std::lock_guard<std::mutex> lock(gLoopMutex);
  if (!gLoop) gLoop = new Loop();
  return *gLoop;
}

uint64_t Loop::generation() { return gGeneration.load(); }

Loop::Loop() : maxThreads_(defaultThreads()) {
  epollFd_ = epoll_create1(EPOLL_CLOEXEC);
  MOO_ENFORCE(epollFd_ >= 0, "epoll_create1: ", std::strerror(errno));
  eventFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  MOO_ENFORCE(eventFd_ >= 0, "eventfd: ", std::strerror(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kEventFdToken;
  MOO_ENFORCE(epoll_ctl(epollFd_, EPOLL_CTL_ADD, eventFd_, &ev) == 0, "epoll_ctl: ", std::strerror(errno));
  std::lock_guard<std::mutex> lock(mutex_);
  // The thread of last resort: it only polls when no other thread can.
  threads_.emplace_back([this] {
    wait([this] { return stopping_; }, kForever, WaitRole::kIo);
  });
  startThreadsLocked();
}

Loop::~Loop() {
  ::close(epollFd_);
  ::close(eventFd_);
}

void Loop::startThreadsLocked() {
  while (liveWorkers_ < maxThreads_ && !stopping_) {
    int index = liveWorkers_++;
    threads_.emplace_back([this, index] { workerMain(index); });
    threads_.back().detach();
  }
}

void Loop::workerMain(int index) {
  while (true) {
    Task task;
    bool retire = false;
    wait(
        [&] {
          if (popTask(task)) return true;
          std::lock_guard<std::mutex> lock(mutex_);
          retire = stopping_ || index >= maxThreads_;
          return retire;
        },
        kForever, WaitRole::kWorker);
    if (task) {
      task();
      continue;
    }
    if (retire) break;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  --liveWorkers_;
}

bool Loop::popTask(Task& out) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (tasks_.empty()) return false;
  out = std::move(tasks_.front());
  tasks_.pop_front();
  return true;
}

void Loop::setMaxThreads(int n) {
  MOO_ENFORCE(n >= 1, "max threads must be at least 1, got ", n);
  std::lock_guard<std::mutex> lock(mutex_);
  maxThreads_ = n;
  startThreadsLocked();
  for (Waiter* w : sleepers_) w->notify();
}

void Loop::shutdown(std::chrono::milliseconds grace) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
    tasks_.clear();
    for (Waiter* w : sleepers_) w->notify();
  }
  kick();
  TimePoint deadline = Clock::now() + grace;
  while (Clock::now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (liveWorkers_ == 0) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  // Threads still inside user callbacks are left to finish on their own.
  for (auto& t : threads_) {
    if (t.joinable()) t.detach();
  }
}

bool Loop::onPollerThread() const { return tlsPollingLoop == this; }

uint64_t Loop::addFd(int fd, uint32_t events, std::weak_ptr<FdHandler> handler) {
  uint64_t token;
  {
    std::lock_guard<std::mutex> lock(fdMutex_);
    token = nextFdToken_++;
    fds_[token] = FdEntry{fd, std::move(handler)};
  }
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = token;
  if (epoll_ctl(epollFd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    std::lock_guard<std::mutex> lock(fdMutex_);
    fds_.erase(token);
    throw Exception(concat("epoll_ctl add: ", std::strerror(errno)));
  }
  return token;
}

void Loop::modifyFd(int fd, uint64_t token, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = token;
  epoll_ctl(epollFd_, EPOLL_CTL_MOD, fd, &ev);
}

void Loop::removeFd(int fd, uint64_t token) {
  epoll_ctl(epollFd_, EPOLL_CTL_DEL, fd, nullptr);
  std::lock_guard<std::mutex> lock(fdMutex_);
  fds_.erase(token);
}

void Loop::post(Task task) {
  bool needKick;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    posted_.push_back(std::move(task));
    needKick = pollerActive_ && !onPollerThread();
  }
  if (needKick) kick();
}

void Loop::schedule(Task task) {
  bool needKick = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    tasks_.push_back(std::move(task));
    Waiter& self = currentWaiter();
    // A worker that is polling picks the task up itself after this poll round.
    if (self.polling_.load() && self.role_ == int(WaitRole::kWorker)) return;
    Waiter* target = nullptr;
    for (Waiter* w : sleepers_) {
      if (w->role_ == int(WaitRole::kWorker)) {
        target = w;
        break;
      }
    }
    if (target) {
      target->notify();
    } else {
      needKick = pollerActive_ && pollerRole_ == int(WaitRole::kWorker);
    }
  }
  if (needKick) kick();
}

uint64_t Loop::addTimer(TimePoint when, Task task) {
  uint64_t id;
  bool earliest;
  {
    std::lock_guard<std::mutex> lock(timerMutex_);
    id = nextTimerId_++;
    earliest = timerHeap_.empty() || when < timerHeap_.front().when;
    timerHeap_.push_back(Timer{when, id});
    std::push_heap(timerHeap_.begin(), timerHeap_.end(), std::greater<Timer>());
    timerTasks_[id] = std::move(task);
  }
  if (earliest && !onPollerThread()) kick();
  return id;
}

void Loop::cancelTimer(uint64_t id) {
  std::lock_guard<std::mutex> lock(timerMutex_);
  timerTasks_.erase(id);  // the heap entry is skipped when it comes due
}

TimePoint Loop::runDueTimers() {
  while (true) {
    Task task;
    {
      std::lock_guard<std::mutex> lock(timerMutex_);
      if (timerHeap_.empty()) return kForever;
      Timer top = timerHeap_.front();
      auto it = timerTasks_.find(top.id);
      if (it != timerTasks_.end() && top.when > Clock::now()) return top.when;
      std::pop_heap(timerHeap_.begin(), timerHeap_.end(), std::greater<Timer>());
      timerHeap_.pop_back();
      if (it == timerTasks_.end()) continue;
      task = std::move(it->second);
      timerTasks_.erase(it);
    }
    task();
  }
}

void Loop::runPosted() {
  while (true) {
    std::vector<Task> batch;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (posted_.empty()) return;
      batch.swap(posted_);
    }
    for (auto& t : batch) t();
  }
}

void Loop::kick() {
  uint64_t one = 1;
  ssize_t r = ::write(eventFd_, &one, sizeof(one));
  (void)r;
}

void Loop::pollOnce(TimePoint deadline) {
  runPosted();
  TimePoint next = std::min(deadline, runDueTimers());
  int timeoutMs = -1;
  if (next != kForever) {
    auto left = std::chrono::duration_cast<std::chrono::microseconds>(next - Clock::now()).count();
    timeoutMs = left <= 0 ? 0 : int(std::min<int64_t>((left + 999) / 1000, 3600 * 1000));
  }
  epoll_event events[64];
  int n = epoll_wait(epollFd_, events, 64, timeoutMs);
  for (int i = 0; i < n; ++i) {
    uint64_t token = events[i].data.u64;
    if (token == kEventFdToken) {
      uint64_t value;
      while (::read(eventFd_, &value, sizeof(value)) > 0) {
      }
      continue;
    }
    std::shared_ptr<FdHandler> handler;
    {
      std::lock_guard<std::mutex> lock(fdMutex_);
      auto it = fds_.find(token);
      if (it != fds_.end()) handler = it->second.handler.lock();
    }
    if (handler) handler->onEvents(events[i].events);
  }
  runPosted();
  runDueTimers();
}

void Loop::wakeSleeperLocked(int minRole) {
  Waiter* best = nullptr;
  for (Waiter* w : sleepers_) {
    if (w->role_ >= minRole && (!best || w->role_ > best->role_)) best = w;
  }
  if (best) best->notify();
}

bool Loop::wait(const std::function<bool()>& ready, TimePoint deadline, WaitRole role) {
  Waiter& w = currentWaiter();
  w.role_ = int(role);
  bool slept = false;
  while (true) {
    if (ready()) {
      if (slept) {
        // Pass the baton: a hand-off may have woken us just as our own
        // condition came true, and somebody must keep polling.
        std::lock_guard<std::mutex> lock(mutex_);
        if (!pollerActive_) wakeSleeperLocked(0);
      }
      return true;
    }
    if (Clock::now() >= deadline) return false;
    std::unique_lock<std::mutex> lock(mutex_);
    if (!pollerActive_) {
      pollerActive_ = true;
      pollerRole_ = int(role);
      yieldRequested_ = false;
      lock.unlock();
      w.polling_ = true;
      tlsPollingLoop = this;
      bool done = false;
      while (!(done = ready()) && Clock::now() < deadline) {
        pollOnce(deadline);
        std::lock_guard<std::mutex> g(mutex_);
        if (yieldRequested_) break;
      }
      tlsPollingLoop = nullptr;
      w.polling_ = false;
      lock.lock();
      pollerActive_ = false;
      yieldRequested_ = false;
      wakeSleeperLocked(0);
      lock.unlock();
      if (done) return true;
      slept = false;
      continue;
    }
    bool needKick = false;
    if (int(role) > pollerRole_ && !yieldRequested_) {
      // A thread with a better use for the poller role (one waiting for a
      // reply, or a worker that would run requests inline) asks for it.
      yieldRequested_ = true;
      needKick = true;
    }
    sleepers_.push_back(&w);
    lock.unlock();
    if (needKick) kick();
    w.sleepUntil(deadline);
    slept = true;
    lock.lock();
    sleepers_.erase(std::find(sleepers_.begin(), sleepers_.end(), &w));
  }
}

}  // namespace moolib
