// A listening stream socket registered with the loop; shared by the TCP and
// shared-memory contexts, which differ only in the address family and in the
// connection they build for each accepted socket.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "runtime/loop.h"
#include "runtime/socket.h"
#include "transport/transport.h"

namespace moolib {

class SocketListener : public Listener,
                       public FdHandler,
                       public std::enable_shared_from_this<SocketListener> {
 public:
  using MakeConnection = std::function<ConnectionPtr(Fd fd)>;
  // Binds and listens; throws with a clear message (e.g. the address is taken).
  static std::shared_ptr<SocketListener> create(const SockAddr& addr, std::string address,
                                                MakeConnection make, Context::AcceptFn onAccept);
  ~SocketListener() override;
  std::string address() const override { return address_; }
  void close() override;
  void onEvents(uint32_t events) override;

  SocketListener(Fd fd, std::string address, MakeConnection make, Context::AcceptFn onAccept);

 private:
  Fd fd_;
  std::string address_;
  MakeConnection make_;
  Context::AcceptFn onAccept_;
  uint64_t token_ = 0;
  std::mutex mutex_;  // held while accepting and closing
  bool closed_ = false;
  // accept() failures are logged at most once a second, with a count.
  TimePoint lastErrorLog_{};
  size_t errorsSinceLog_ = 0;
};

// A Listener handle that closes the shared listener when dropped.
class ListenerHandle : public Listener {
 public:
  explicit ListenerHandle(std::shared_ptr<SocketListener> l) : listener_(std::move(l)) {}
  ~ListenerHandle() override { listener_->close(); }
  std::string address() const override { return listener_->address(); }
  void close() override { listener_->close(); }

 private:
  std::shared_ptr<SocketListener> listener_;
};

// Descriptors are a process-wide resource: when accept() runs out of them, the
// listener asks every registered owner of connections to give some back (an
// Rpc closes its oldest handshakes in progress) rather than leave the new
// connection, maybe a legitimate peer, waiting behind idle ones. release()
// returns how many connections it closed; it runs on the poller. The owner is
// registered until the returned handle is dropped.
std::shared_ptr<void> addDescriptorRelief(std::function<size_t()> release);
size_t relieveDescriptors();

// Starts a non-blocking connect; calls done on the poller.
void connectSocket(const SockAddr& addr, std::string address,
                   std::function<ConnectionPtr(Fd fd)> make, Context::ConnectFn done);

}  // namespace moolib
