#include "transport/socket_listener.h"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>

#include "runtime/logging.h"

namespace moolib {

namespace {

struct ReliefRegistry {
  std::mutex mutex;
  std::vector<std::weak_ptr<std::function<size_t()>>> entries;
};

ReliefRegistry& reliefRegistry() {
  // Leaked on purpose: listeners may accept while static destructors run.
  static auto* registry = new ReliefRegistry();
  return *registry;
}

}  // namespace

std::shared_ptr<void> addDescriptorRelief(std::function<size_t()> release) {
  auto entry = std::make_shared<std::function<size_t()>>(std::move(release));
  auto& r = reliefRegistry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.entries.erase(
      std::remove_if(r.entries.begin(), r.entries.end(), [](auto& w) { return w.expired(); }),
      r.entries.end());
  r.entries.push_back(entry);
  return entry;
}

size_t relieveDescriptors() {
  std::vector<std::shared_ptr<std::function<size_t()>>> owners;
  {
    auto& r = reliefRegistry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto& w : r.entries) {
      if (auto e = w.lock()) owners.push_back(std::move(e));
    }
  }
  // Called without the registry's lock: release() takes its owner's locks.
  size_t released = 0;
  for (auto& release : owners) {
    released += (*release)();
    if (released) break;
  }
  return released;
}

SocketListener::SocketListener(Fd fd, std::string address, MakeConnection make,
                               Context::AcceptFn onAccept)
    : fd_(std::move(fd)),
      address_(std::move(address)),
      make_(std::move(make)),
      onAccept_(std::move(onAccept)) {}

std::shared_ptr<SocketListener> SocketListener::create(const SockAddr& addr, std::string address,
                                                       MakeConnection make,
                                                       Context::AcceptFn onAccept) {
  Fd fd(::socket(addr.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  MOO_ENFORCE(fd, "socket: ", errnoString(errno));
  if (addr.family() != AF_UNIX) {
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  }
  if (::bind(fd.get(), addr.get(), addr.length) != 0) {
    int err = errno;
    throw Exception(concat("cannot listen on ", address, ": ", errnoString(err),
                           err == EADDRINUSE ? " (the address is taken by another process)" : ""));
  }
  MOO_ENFORCE(::listen(fd.get(), 1024) == 0, "cannot listen on ", address, ": ",
              errnoString(errno));
  auto l = std::make_shared<SocketListener>(std::move(fd), std::move(address), std::move(make),
                                            std::move(onAccept));
  if (addr.family() != AF_UNIX) {
    SockAddr bound;
    bound.length = sizeof(bound.storage);
    ::getsockname(l->fd_.get(), bound.get(), &bound.length);
    l->address_ = formatTcpAddress(bound);
  }
  // Held so that an early event cannot re-arm with a token not yet stored.
  std::lock_guard<std::mutex> lock(l->mutex_);
  l->token_ = Loop::instance().addFd(l->fd_.get(), EPOLLIN, std::weak_ptr<FdHandler>(l));
  return l;
}

SocketListener::~SocketListener() = default;

void SocketListener::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;
  closed_ = true;
  Loop::instance().removeFd(fd_.get(), token_);
  fd_.reset();
}

void SocketListener::onEvents(uint32_t) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int i = 0; i < 64 && !closed_; ++i) {
    int fd = ::accept4(fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      // Out of descriptors (or similar): the pending connection stays
      // queued and readiness would fire again at once. Ask for descriptors
      // back and retry soon if some were (their sockets close on the poller),
      // else back off instead of spinning. Under a flood this repeats many
      // times a second: say so at most once a second.
      int err = errno;
      size_t released = err == EMFILE || err == ENFILE ? relieveDescriptors() : 0;
      ++errorsSinceLog_;
      auto now = Clock::now();
      if (now - lastErrorLog_ >= std::chrono::seconds(1)) {
        MOO_LOG(kError, "accept on ", address_, ": ", errnoString(err), " (", errorsSinceLog_,
                errorsSinceLog_ == 1 ? " time" : " times", " since the last report); ",
                released ? "closing handshakes in progress to make room" : "retrying in 100 ms");
        lastErrorLog_ = now;
        errorsSinceLog_ = 0;
      }
      std::weak_ptr<SocketListener> weak = shared_from_this();
      auto delay = std::chrono::milliseconds(released ? 10 : 100);
      Loop::instance().addTimer(Clock::now() + delay, [weak] {
        if (auto self = weak.lock()) {
          std::lock_guard<std::mutex> lock(self->mutex_);
          if (!self->closed_) Loop::instance().rearm(self->fd_.get(), self->token_, EPOLLIN);
        }
      });
      return;
    }
    try {
      onAccept_(make_(Fd(fd)));
    } catch (const std::exception& e) {
      MOO_LOG(kError, "accepting a connection on ", address_, ": ", e.what());
    }
  }
  if (!closed_) Loop::instance().rearm(fd_.get(), token_, EPOLLIN);
}

namespace {

class Connector : public FdHandler, public std::enable_shared_from_this<Connector> {
 public:
  Connector(Fd fd, std::string address, std::function<ConnectionPtr(Fd)> make,
            Context::ConnectFn done)
      : fd_(std::move(fd)),
        address_(std::move(address)),
        make_(std::move(make)),
        done_(std::move(done)) {}

  void start() {
    auto self = shared_from_this();
    // Keep ourselves alive until the connect completes or times out.
    {
      std::lock_guard<std::mutex> lock(mutex_);
      keepalive_ = self;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    token_ = Loop::instance().addFd(fd_.get(), EPOLLOUT, std::weak_ptr<FdHandler>(self));
    timer_ = Loop::instance().addTimer(Clock::now() + std::chrono::seconds(20), [self] {
      self->finish(Error(concat("connecting to ", self->address_, " timed out")));
    });
  }

  void onEvents(uint32_t) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (done) return;
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd_.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err == EINPROGRESS) {
      Loop::instance().rearm(fd_.get(), token_, EPOLLOUT);
      return;
    }
    Loop::instance().cancelTimer(timer_);
    lock.unlock();
    finish(err ? Error(concat("cannot connect to ", address_, ": ", errnoString(err))) : Error());
  }

 private:
  void finish(const Error& error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (done) return;
      done = true;
    }
    Loop::instance().removeFd(fd_.get(), token_);
    ConnectionPtr conn;
    Error e = error;
    if (!e) {
      try {
        conn = make_(std::move(fd_));
      } catch (const std::exception& ex) {
        e = Error(ex.what());
      }
    }
    done_(e, conn);
    std::shared_ptr<Connector> self;  // released last: it may be the final reference
    std::lock_guard<std::mutex> lock(mutex_);
    self = std::move(keepalive_);
  }

  Fd fd_;
  std::string address_;
  std::function<ConnectionPtr(Fd)> make_;
  Context::ConnectFn done_;
  uint64_t token_ = 0;
  uint64_t timer_ = 0;
  bool done = false;
  std::mutex mutex_;
  std::shared_ptr<Connector> keepalive_;
};

}  // namespace

void connectSocket(const SockAddr& addr, std::string address,
                   std::function<ConnectionPtr(Fd fd)> make, Context::ConnectFn done) {
  Fd fd(::socket(addr.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) {
    Error e(concat("socket: ", errnoString(errno)));
    Loop::instance().addTimer(Clock::now(), [done, e] { done(e, nullptr); });
    return;
  }
  int r = ::connect(fd.get(), addr.get(), addr.length);
  if (r != 0 && errno != EINPROGRESS) {
    Error e(concat("cannot connect to ", address, ": ", errnoString(errno)));
    Loop::instance().addTimer(Clock::now(), [done, e] { done(e, nullptr); });
    return;
  }
  auto c = std::make_shared<Connector>(std::move(fd), std::move(address), std::move(make),
                                       std::move(done));
  c->start();
}

}  // namespace moolib
