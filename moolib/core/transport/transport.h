// The transport interface: a Context creates Listeners and outgoing
// Connections for one kind of link (shared memory, TCP, UCX). The RPC layer
// only sees frames; how segments travel is the transport's business. Each
// transport is one folder (transport/<name>/: context_impl.cc,
// connection_impl.h, connection_impl.cc) and one entry of the registry
// (transport/registry.cc), which the RPC layer consults for every choice.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "rpc/wire.h"
#include "runtime/error.h"
#include "runtime/future.h"
#include "runtime/loop.h"

namespace moolib {

// A link's I/O; as a ReplySource, a thread waiting for a reply on it serves
// it itself.
class Connection : public ReplySource {
 public:
  using FrameFn = std::function<void(IncomingFrame&&)>;
  using CloseFn = std::function<void(const Error&)>;

  virtual ~Connection() = default;
  // Called once before any frame can arrive; both callbacks run on the poller.
  // onClose runs exactly once, after which nothing more arrives.
  virtual void start(FrameFn onFrame, CloseFn onClose) = 0;
  // Thread safe. Writes inline when the socket accepts it, else queues.
  // Frames sent on a closed connection are dropped.
  virtual void send(OutgoingFrame&& frame) = 0;
  // Writes frames that send() held back to coalesce a burst.
  virtual void flush() = 0;
  // Thread safe and idempotent.
  virtual void close(const Error& reason) = 0;
  // Lifts the size limits that apply before the RPC handshake completes.
  virtual void setHandshaken() = 0;
  virtual bool closed() const = 0;
  virtual const char* transport() const = 0;
  virtual std::string localAddress() const = 0;
  virtual std::string remoteAddress() const = 0;
  virtual uint64_t bytesSent() const = 0;
  virtual uint64_t bytesReceived() const = 0;
  // What carries the bytes beneath this transport, where that is chosen
  // below it (UCX: its endpoint's lanes); empty otherwise.
  virtual std::string lanes() const { return ""; }
  // Takes the connection's I/O from the loop ahead of a wait for a reply to a
  // request not yet sent, so that a reply quicker than the caller cannot wake
  // a loop worker (a second wake-up and a hand-off). The claim ends in
  // serveWhile(..., true) or unclaim(). False if another thread handles the
  // connection.
  virtual bool claim() { return false; }
};
using ConnectionPtr = std::shared_ptr<Connection>;

class Listener {
 public:
  virtual ~Listener() = default;
  // The address peers can dial, with the real port when port 0 was asked for.
  virtual std::string address() const = 0;
  virtual void close() = 0;
};

// Whether a transport can carry a link to a given peer.
struct Reach {
  enum Kind {
    kNo,      // not at all (the peer lacks it, or it cannot get there)
    kForced,  // only when set_transports() names it
    kAuto,    // chosen by priority
  };
  Kind kind = kNo;
  std::string why;
};

class Context {
 public:
  using AcceptFn = std::function<void(ConnectionPtr)>;
  using ConnectFn = std::function<void(const Error&, ConnectionPtr)>;

  virtual ~Context() = default;
  virtual const char* name() const = 0;
  // Among transports both sides can use, the highest priority carries calls.
  virtual int priority() const = 0;
  // What this transport reaches from here, sent to peers in the handshake
  // (shm: the host identity; tcp: the addresses it listens on; ucx: the
  // devices and transports UCX found). Bounded: at most 1024 bytes.
  virtual std::string domain() const = 0;
  // Whether a link to a peer whose domain for this transport is peerDomain
  // ("" when the peer did not report one) can use this transport.
  virtual Reach reach(const std::string& peerDomain, bool sameHost) const = 0;
  // Addresses that only mean something on this host (never told to peers
  // on another host).
  virtual bool hostLocal() const { return false; }
  // Whether this transport dials/listens on addresses of this form.
  virtual bool handles(const std::string& address) const = 0;
  // Throws when an address it handles can never connect, judging its form
  // alone (nothing is resolved), so that connect() raises at once instead of
  // redialing it forever.
  virtual void checkAddress(const std::string& address) const {}
  // An address to listen on without being asked, beside a TCP listener on
  // tcpAddress ("" when connect() alone started the Rpc), so that peers can
  // upgrade a link to this transport; "" for none. incarnation is unique to
  // the Rpc. forced: set_transports() names this transport.
  virtual std::string companionAddress(const std::string& incarnation,
                                       const std::string& tcpAddress, bool forced) const {
    return "";
  }
  // Binds synchronously (so errors raise at the call); accepts on the poller.
  virtual std::unique_ptr<Listener> listen(const std::string& address, AcceptFn onAccept) = 0;
  // Completes on the poller, with an error or a connection not yet started.
  virtual void connect(const std::string& address, ConnectFn done) = 0;
};

// Addresses of the form "<scheme>://host:port" (ucx) or "host:port" (tcp):
// the host:port part; anything else unchanged.
std::string hostPortOf(const std::string& address);

}  // namespace moolib
