// The process-wide event loop and thread pool.
//
// Every pool worker blocks in epoll_wait on one shared epoll set; file
// descriptors are registered EPOLLONESHOT, so one fd is handled by one thread
// at a time and its handler re-arms it when done. Linux wakes the most recent
// epoll waiter first, so the thread that reads a request is a warm worker, and
// it runs the request itself: no hand-off to another thread.
//
// A thread waiting for a reply does not wait for a worker to read it: it takes
// the connection the reply will come on out of the epoll set and polls it
// itself (see StreamConnection::serveWhile), so the reply wakes the very
// thread that needs it. Cross-CPU thread wake-ups are the dominant cost of a
// round trip on virtual machines; this design avoids them on the fast path.
//
// If every worker is busy in a long callback, a rescue thread polls in their
// place every few milliseconds, so I/O, timers and keepalives never stall. It
// also hands the requests a worker read along with one that runs long (or
// blocks) to other workers, and sends the replies already made.
//
// Nested calls. A function that calls another peer and waits (sync()) holds
// its worker until the reply comes, and that reply may need a worker of this
// very pool: the called function may call back into this process, directly
// or through other peers, in any number of rounds. With a fixed pool, enough
// such calls in flight leave every worker blocked while the requests whose
// replies they wait for sit in the queue behind them: a deadlock that no
// timeout but the calls' own ends. So max threads bounds the workers that
// *run*, not those that wait: a worker about to block in a wait
// (BlockingRegion, entered by FutureState::wait)
//   - first hands the rest of the batch it read to the pool and sends the
//     replies corked in it: they must not wait for a reply that may need them
//     (the rescue thread would, but only 20 ms later, and only to a pool that
//     has a worker to run them);
//   - then, if fewer than max threads workers are left to run tasks, starts
//     a spare worker in its place. Starting one is cheap next to what it
//     prevents, and happens only when a worker blocks while the pool is
//     short; spares stay until no worker has blocked for a few seconds, so a
//     steady stream of nested calls does not start a thread per call.
// Replacements are bounded (kMaxBlockedWorkers): a program that blocks more
// workers than that at once gets a logged error rather than unbounded threads.
// The alternative, a waiting thread running queued requests itself, would
// nest functions on one stack: the outer one could not return, its reply
// arrived, until the inner one did, which may be waiting for the outer.
// Waiting threads do serve the connection their reply comes on (see
// StreamConnection::serveWhile), and the rescue thread polls when no worker
// waits for events, so replies are read even while every worker is blocked.
//
// Nothing here takes the Python GIL. docs/architecture.md (section 2) puts
// these threads in context.
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
  // Called on a loop thread after the fd fired. The fd is disarmed until the
  // handler calls Loop::rearm.
  virtual void onEvents(uint32_t events) = 0;
  // A worker that just ran requests from this fd may keep serving it by
  // itself until the deadline (see Loop::workerMain). Returns whether any
  // I/O happened; false if the fd cannot be served that way.
  virtual bool serveSticky(TimePoint deadline) { return false; }
  // Takes back an fd lent to the tasks a sticky worker runs (see
  // Loop::runInlineTasks): they blocked or ran long, so the loop serves it.
  virtual void takeBack() {}
};

// A per-thread wake-up slot backed by an eventfd, so a thread can sleep on it
// and on a socket at the same time.
class Waiter {
 public:
  Waiter();
  ~Waiter();
  void notify();
  // Sleeps until notified or the deadline.
  void sleepUntil(TimePoint deadline);
  int fd() const { return fd_; }
  void clear();

 private:
  int fd_ = -1;
};

// This thread's Waiter, created (an eventfd opened) on first use; throws if
// no descriptor is left.
Waiter& currentWaiter();
// This thread's Waiter if it has one: for code that only compares against it
// and must not fail when descriptors run out.
Waiter* existingWaiter();

// While a worker runs a batch of requests it read, the replies they send are
// corked: queued per connection and written together when the batch ends.
class Corkable {
 public:
  virtual ~Corkable() = default;
  virtual void uncork() = 0;
};
// True (and remembers c) when the calling thread is corked.
bool corkIfBatching(const std::shared_ptr<Corkable>& c);
// Milliseconds for poll/epoll until the deadline (-1: forever), rounded up.
int timeoutMs(TimePoint deadline);

struct InlineBatch;

// Entered by a thread about to block until a call completes. On a pool worker
// it hands the batch it runs to the pool and, while the worker is blocked,
// does not count it against max threads (see the header comment). Elsewhere
// (and when nested) it does nothing.
class BlockingRegion {
 public:
  BlockingRegion();
  ~BlockingRegion();
  BlockingRegion(const BlockingRegion&) = delete;
  BlockingRegion& operator=(const BlockingRegion&) = delete;

 private:
  bool counted_ = false;
};

class Loop {
 public:
  // The loop of this process. A child created by fork() gets a fresh one; the
  // parent's is abandoned there (its threads do not exist in the child).
  static Loop& instance();
  static uint64_t generation();

  uint64_t addFd(int fd, uint32_t events, std::weak_ptr<FdHandler> handler);
  // Re-enables delivery for fd (events 0 keeps it disarmed).
  void rearm(int fd, uint64_t token, uint32_t events);
  void removeFd(int fd, uint64_t token);

  // Runs task on a worker. A worker that is handling I/O keeps the task and
  // runs it itself right after; other threads queue it.
  void schedule(Task task);
  uint64_t addTimer(TimePoint when, Task task);
  void cancelTimer(uint64_t id);

  // For a thread serving an fd itself: whether requests it read wait to run
  // here, and running them.
  static bool hasInlineTasks();
  static bool onWorkerThread();
  // Runs them while lent (when set) stays out of the loop: the peer's next
  // request is read by this thread once they are done, with no epoll_ctl
  // pair around them and no loop worker woken for it. The loop takes lent
  // back (FdHandler::takeBack) from a task that blocks in a wait, from a batch
  // that outruns the inline budget, and from a stuck batch (rescue thread).
  void runInlineTasks(const std::shared_ptr<FdHandler>& lent = nullptr);
  // Whether a worker serving an fd by itself should go back to the pool.
  bool stickyShouldStop() const { return stopping_ || queued_.load() > 0; }

  void setMaxThreads(int n);
  int maxThreads() const { return maxThreads_; }
  // Stops accepting tasks and waits (bounded) for workers; for interpreter exit.
  void shutdown(std::chrono::milliseconds grace);

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

  friend class BlockingRegion;
  // A pool worker blocks in a wait: see BlockingRegion.
  void beginBlocking();
  void endBlocking();
  // index -1: a spare, started in place of a blocked worker; it ends once
  // the pool has more runnable workers than max threads and no worker has
  // blocked for a while.
  void workerMain(int index);
  // Creates this worker's Waiter; false (logged on the first try) when no
  // descriptor is left.
  bool tryCreateWaiter(int index, bool firstTry);
  void rescueMain();
  // One epoll_wait round; returns the number of events.
  int pollRound(int timeout, bool worker);
  std::shared_ptr<FdHandler> dispatch(uint64_t token, uint32_t events);
  void runTimers();
  void armTimerFdLocked();
  bool popTask(Task& out);
  void runInline();
  // Moves tasks to the shared queue and wakes workers for them.
  void enqueue(std::deque<Task>& tasks);
  // Adds n tasks to the shared queue through push, under its lock, and wakes
  // workers for them.
  template <typename Push>
  void pushShared(uint64_t n, Push&& push);
  // Rescue thread: hands the rest of a batch whose task runs too long to the pool.
  void rescueStuckBatches();

  int epollFd_ = -1;
  int taskFd_ = -1;  // counts queued tasks (EFD_SEMAPHORE): wakes one worker per task
  int timerFd_ = -1;

  std::mutex mutex_;
  std::deque<Task> tasks_;
  std::atomic<bool> stopping_{false};
  int maxThreads_;
  int liveWorkers_ = 0;      // spares included
  int blockedWorkers_ = 0;   // live workers blocked in a wait
  TimePoint lastBlocked_{};  // when a worker last began to
  bool warnedBlockedLimit_ = false;
  std::vector<bool> workerLive_;  // by worker index
  int startingWorkers_ = 0;       // spawned, not yet past creating their Waiter
  std::condition_variable workersStarted_;
  std::atomic<int> idleWorkers_{0};
  std::atomic<int> queued_{0};
  std::vector<Waiter*> stickyWorkers_;

  std::mutex batchesMutex_;  // taken before a batch's own mutex, then mutex_
  std::vector<InlineBatch*> batches_;

  std::mutex timerMutex_;
  std::vector<Timer> timerHeap_;
  std::unordered_map<uint64_t, Task> timerTasks_;
  uint64_t nextTimerId_ = 1;
  TimePoint timerFdDue_ = kForever;

  std::mutex fdMutex_;
  std::unordered_map<uint64_t, FdEntry> fds_;
  uint64_t nextFdToken_ = 16;
};

}  // namespace moolib
