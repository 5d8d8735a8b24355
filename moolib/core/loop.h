// The process-wide event loop and thread pool.
//
// There is no dedicated I/O thread on the fast path: any thread that has to
// wait (a pool worker waiting for a task, a caller waiting for a reply) may
// take the single *poller* role and run epoll itself. The thread that reads a
// reply is then usually the one waiting for it, and a worker that reads a
// request runs it itself, which saves a thread hop in each direction. One
// thread of last resort (role kIo) polls when every other thread is busy, so
// I/O, timers and keepalives never stall behind long Python callbacks.
//
// Contract:
// - fd handlers, posted tasks and timers run on the poller, one at a time, so
//   the I/O state they touch needs no other lock against itself;
// - scheduled tasks run on pool workers, concurrently;
// - nothing here takes the Python GIL.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace moolib {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;
using Task = std::function<void()>;

constexpr TimePoint kForever = TimePoint::max();

class FdHandler {
 public:
  virtual ~FdHandler() = default;
  virtual void onEvents(uint32_t events) = 0;
};

// Per-thread wait slot. notify() makes a blocked wait() re-check its predicate.
class Waiter {
 public:
  void notify();
  void sleepUntil(TimePoint deadline);

 private:
  friend class Loop;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool signaled_ = false;
  std::atomic<bool> polling_{false};
  int role_ = 0;
};

Waiter& currentWaiter();

enum class WaitRole : int { kIo = 0, kWorker = 1, kCaller = 2 };

class Loop {
 public:
  // The loop of this process. A child created by fork() gets a fresh one; the
  // parent's is abandoned there (its threads do not exist in the child).
  static Loop& instance();
  static uint64_t generation();

  // Registers fd; the handler is called on the poller while it is alive.
  uint64_t addFd(int fd, uint32_t events, std::weak_ptr<FdHandler> handler);
  void modifyFd(int fd, uint64_t token, uint32_t events);
  void removeFd(int fd, uint64_t token);

  void post(Task task);
  void schedule(Task task);
  uint64_t addTimer(TimePoint when, Task task);
  void cancelTimer(uint64_t id);

  // Blocks until ready() or the deadline. Returns ready().
  bool wait(const std::function<bool()>& ready, TimePoint deadline, WaitRole role);
  // Interrupts epoll_wait so the poller re-checks its state.
  void kick();

  void setMaxThreads(int n);
  int maxThreads() const { return maxThreads_; }
  // Stops accepting tasks and waits (bounded) for workers; for interpreter exit.
  void shutdown(std::chrono::milliseconds grace);
  bool onPollerThread() const;

  Loop();
  ~Loop();
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;

 private:
  struct Timer {
    TimePoint when;
    uint64_t id;
    bool operator>(const Timer& o) const { return when > o.when; }
  };
  struct FdEntry {
    int fd;
    std::weak_ptr<FdHandler> handler;
  };

  void pollOnce(TimePoint deadline);
  TimePoint runDueTimers();
  void runPosted();
  void startThreadsLocked();
  void workerMain(int index);
  bool popTask(Task& out);
  void wakeSleeperLocked(int minRole);

  int epollFd_ = -1;
  int eventFd_ = -1;

  std::mutex mutex_;
  bool pollerActive_ = false;
  int pollerRole_ = 0;
  bool yieldRequested_ = false;
  std::vector<Waiter*> sleepers_;
  std::deque<Task> tasks_;
  std::vector<Task> posted_;
  bool stopping_ = false;
  int maxThreads_;
  int liveWorkers_ = 0;
  std::vector<std::thread> threads_;

  std::mutex timerMutex_;
  std::vector<Timer> timerHeap_;
  std::unordered_map<uint64_t, Task> timerTasks_;
  uint64_t nextTimerId_ = 1;

  std::mutex fdMutex_;
  std::unordered_map<uint64_t, FdEntry> fds_;
  uint64_t nextFdToken_ = 1;
};

}  // namespace moolib
