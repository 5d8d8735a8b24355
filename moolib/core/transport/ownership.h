// Who serves a transport's I/O, one at a time: the loop or a thread that took
// it (docs/architecture.md, sections 2 and 4, "UCX"). One protocol for the
// stream transports' connections (StreamConnection: a socket each) and UCX's
// worker (UcxRuntime: its event fd), so that a change to its rules reaches
// both.
//
// - The loop: the fd is armed in the loop's epoll set (EPOLLONESHOT) and the
//   worker its event wakes serves it. A stream connection marks that worker
//   as handling the fd (beginHandlingLocked), and no thread may own it
//   meanwhile; UCX's workers progress under UCX's mutex and need no mark.
// - An owner: a thread took the fd out of the epoll set (tryOwnLocked) to
//   serve the I/O itself, so that what arrives wakes only that thread: a
//   caller waiting for a reply, or the sticky worker that just ran requests
//   read from it. It hands the I/O back (disownLocked) and re-arms the fd
//   (armLocked).
// - Lent: the owner runs the requests it read inline (runLent), the I/O lent
//   to them. A request that calls back over it takes it over (claimLocked,
//   on the lender's thread); the loop takes it back (takeBackLocked) from a
//   request that blocks or runs long. Either way the owner serves on only if
//   it can own the I/O again.
//
// Not a lock of its own: every method but runLent is called with the guard
// held, the mutex that also guards what the transport decides along with it
// (a stream connection's state mutex; the UCX runtime's one mutex).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>

#include "runtime/loop.h"

namespace moolib {

class IoOwnership {
 public:
  explicit IoOwnership(std::mutex& guard) : guard_(guard) {}
  IoOwnership(const IoOwnership&) = delete;
  IoOwnership& operator=(const IoOwnership&) = delete;

  // The fd is in the loop's epoll set under token, armed or not. Until then
  // nobody may own it.
  void attachLocked(int fd, uint64_t token, bool armed);
  uint64_t token() const { return token_; }
  bool owned() const { return owned_; }
  bool closed() const { return closed_; }

  // The loop's side.
  // The fd's event came: EPOLLONESHOT disarmed it.
  void firedLocked() { armed_ = false; }
  // The woken worker handles the fd, unless a thread owns it, another handles
  // it or it is closed; armed can be stale (an arm between the event's
  // delivery and here), and the one who handles or owns the fd re-arms it, so
  // backing off loses nothing (readiness is level-triggered).
  bool beginHandlingLocked();
  // Done handling: re-arms the fd for events unless a thread owns it now.
  void endHandlingLocked(uint32_t events);
  // Puts the fd back in the epoll set, waiting for events, unless a thread
  // owns it, it is armed already or closed.
  void armLocked(uint32_t events);
  // Changes the events an armed fd waits for.
  void updateLocked(uint32_t events);
  // Takes back I/O lent to inline requests (FdHandler::takeBack): whether it
  // was lent. Nobody owns it then, and the caller re-arms the fd.
  bool takeBackLocked();
  // The fd leaves the loop for good: never armed or owned again. False if it
  // had already.
  bool closeLocked();

  // A thread's side.
  // Takes the I/O from the loop (the fd out of the epoll set); false if a
  // thread owns it, the loop handles it, or it is closed.
  bool tryOwnLocked();
  // As tryOwnLocked, except that a request run inline by the owner takes over
  // the I/O lent to it; the owner gets it back through runLent.
  bool claimLocked();
  // No thread owns the I/O any more; the caller re-arms the fd.
  void disownLocked() { owned_ = false; }
  // The owner runs the requests it read (Loop::runInlineTasks) with the I/O
  // lent to them, handler being what the loop takes back. Whether it still
  // owns the I/O afterwards: kept, or free again and owned anew (a request
  // that called back over it took it and let go); false when the loop took it
  // back or another thread owns it. Takes the guard.
  bool runLent(const std::shared_ptr<FdHandler>& handler);

 private:
  std::mutex& guard_;
  int fd_ = -1;
  uint64_t token_ = 0;
  bool armed_ = false;
  bool handling_ = false;
  bool owned_ = false;
  bool closed_ = false;
  bool lent_ = false;
  std::thread::id lender_;  // the owner that lent the I/O
};

}  // namespace moolib
