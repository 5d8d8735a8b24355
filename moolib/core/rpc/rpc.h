// An RPC peer: a name, listeners, links to other peers over the best transport
// both sides have, and the calls in flight.
//
// Peers are addressed by name. A call to a name with no link is queued while
// the peer is looked up through every connected peer (kFindPeer/kPeerInfo) and
// dialed directly; it fails with a timeout error if that does not happen in
// time. Frames are handled on the loop's poller; functions run on its workers.
//
// Files: rpc.cc (API, calls, requests), rpc_links.cc (handshake, links,
// discovery, keepalive, reconnection).
#pragma once

#include <atomic>
#include <condition_variable>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/future.h"
#include "transport/registry.h"
#include "transport/transport.h"

namespace moolib {

class Rpc;

// Answers one incoming call; call reply() or error() once, from any thread.
// Dropping it unanswered answers with an error.
class Responder {
 public:
  // With local set, the call came from this very peer and the answer
  // completes that future directly.
  Responder(std::weak_ptr<Rpc> rpc, std::string peer, std::weak_ptr<Connection> conn,
            uint64_t callId, std::string function, FuturePtr local = nullptr);
  ~Responder();
  void reply(std::vector<OutSegment> segments);
  // The caller's future fails with code (a handler in the core may say what
  // kind of failure it is; Python functions answer kRemoteException).
  void error(const std::string& message, ErrorCode code = ErrorCode::kRemoteException);
  const std::string& peer() const { return peer_; }
  const std::string& function() const { return function_; }

 private:
  void send(ErrorCode status, const std::string& error, std::vector<OutSegment> segments);
  std::weak_ptr<Rpc> rpc_;
  std::string peer_;
  std::weak_ptr<Connection> conn_;
  uint64_t callId_;
  std::string function_;
  FuturePtr local_;
  std::atomic<bool> answered_{false};
};

struct ConnectionInfo {
  std::string transport, local, remote;
  bool outgoing;
  uint64_t bytesSent, bytesReceived;
  std::string why;    // why this link was made
  std::string lanes;  // Connection::lanes()
};
struct PeerInfo {
  std::string name;
  bool sameHost;
  std::vector<std::string> addresses;
  std::vector<ConnectionInfo> connections;
  size_t queuedCalls;
  // The transport calls to this peer use ("" while no link is usable), the
  // one the registry chooses, and why.
  std::string transport, chosen, why;
};
struct DebugInfo {
  std::string name;
  std::vector<std::string> listening, advertised, transports;
  std::vector<TransportStatus> available;  // every registered transport
  std::vector<PeerInfo> peers;
  size_t pendingCalls, unidentifiedConnections;
  std::vector<std::string> functions;
};

class Rpc : public std::enable_shared_from_this<Rpc> {
 public:
  // Runs on a pool worker; answer through the responder.
  using Handler = std::function<void(std::shared_ptr<Responder>, std::vector<BufferPtr>)>;

  static std::shared_ptr<Rpc> create();
  ~Rpc();
  Rpc(const Rpc&) = delete;
  Rpc& operator=(const Rpc&) = delete;

  void setName(const std::string& name);
  std::string name() const;
  // Returns the bound address ("127.0.0.1:0" gives the real port).
  std::string listen(const std::string& address);
  // Dials now and again whenever the link drops, until close().
  void connect(const std::string& address);
  void setTimeout(double seconds);
  double timeout() const;
  void setTransports(const std::vector<std::string>& names);
  bool transportAllowed(const std::string& name) const;
  void setAuthKey(const std::string& key);

  void define(const std::string& name, Handler handler);
  bool isDefined(const std::string& name);
  // Waits for calls of this function in flight (not when called from one).
  void undefine(const std::string& name);
  // waitNext: the caller waits for the result right away (sync), so it takes
  // the connection before the request goes out (Connection::claim).
  // timeoutSeconds: how long the call may take; 0, this Rpc's timeout.
  FuturePtr call(const std::string& peer, const std::string& function,
                 std::vector<OutSegment> segments, bool waitNext = false,
                 double timeoutSeconds = 0);
  DebugInfo debugInfo();
  // Runs handler(peer) on a loop thread, outside this Rpc's lock, whenever a
  // peer's last link closes without this Rpc having closed it for silence
  // (the keepalive): the peer closed it or its process ended, not a hang or
  // a partition. Runs until the returned token is dropped.
  using PeerLostHandler = std::function<void(const std::string& peer)>;
  std::shared_ptr<void> onPeerLost(PeerLostHandler handler);
  // Whether a link to the peer is up now.
  bool linkedTo(const std::string& peer) const;
  // Closes the listeners and links before it returns; calls in flight fail.
  void close();
  // Whether this Rpc was made before the process forked (in a child): its
  // threads and loop are the parent's, so it must be left alone.
  bool inherited() const;

  Rpc();  // use create()

 private:
  friend class Responder;
  struct Link;
  struct Peer;
  struct QueuedCall {
    uint64_t id;
    std::string function;
    std::vector<OutSegment> segments;
  };
  struct PendingCall {
    std::string peer, function;
    double timeoutSeconds = 0;
    FuturePtr future;
    bool sent = false;
    // Of the peer the request went to: once no link to that incarnation is
    // left, no reply can come.
    std::string incarnation;
    TimePoint created = Clock::now();
  };
  struct Dialer {
    std::string address;
    bool active = false;  // connecting or connected
    int failures = 0;
    TimePoint nextAttempt;
    TimePoint failingSince;  // of the current run of failures
    bool warned = false;     // that run was logged
    std::string lastError;   // of that run: named by calls that find no peer
  };

  void checkUsable() const;
  void ensureStarted();
  Context* contextFor(const std::string& address);
  bool allowed(const std::string& transport) const;
  // What the registry needs to choose a transport for this peer.
  PeerTransports peerTransportsLocked(const std::string& host,
                                      const std::map<std::string, std::string>& domains,
                                      bool reported) const;

  // rpc.cc
  void sendRequest(const std::shared_ptr<Link>& link, uint64_t id, const std::string& function,
                   std::vector<OutSegment> segments);
  void onRequest(const std::shared_ptr<Link>& link, IncomingFrame& frame);
  void onResponse(IncomingFrame& frame);
  void callLocal(const FuturePtr& future, uint64_t id, const std::string& function,
                 std::vector<OutSegment>& segs);
  void sendResponse(const std::string& peer, const std::weak_ptr<Connection>& conn,
                    OutgoingFrame&& frame);
  void finishCall(const std::string& function);
  static void runHandler(const Rpc& rpc, const Handler& handler,
                         std::shared_ptr<Responder> responder, const std::string& function,
                         std::vector<BufferPtr> args);
  void expireCalls(TimePoint now);
  // Fails the calls sent to this incarnation of the peer (mutex_ held; the
  // futures go to out, to be failed once it is released).
  void takeCallsToLocked(const std::string& peer, const std::string& incarnation,
                         std::vector<PendingCall>& out);

  // rpc_links.cc
  // why: what made the link (debug_info); by default from the other arguments.
  // dialing: the address in dialing_ this link was dialed for, left there
  // until its handshake ends, so that no second link is dialed meanwhile.
  void adopt(ConnectionPtr conn, bool outgoing, const std::string& dialAddress,
             const std::string& why = "", const std::string& dialing = "");
  void onFrame(const std::shared_ptr<Link>& link, IncomingFrame&& frame);
  void onLinkClosed(const std::shared_ptr<Link>& link, const Error& error);
  // A link this Rpc dialed failed authentication: calls that then find no
  // peer fail with kAuthenticationFailed rather than a timeout.
  void noteAuthFailure(const std::shared_ptr<Link>& link, const std::string& why);
  void onHello(const std::shared_ptr<Link>& link, Reader& r);
  void onAuth(const std::shared_ptr<Link>& link, Reader& r);
  void onIdentify(const std::shared_ptr<Link>& link, Reader& r);
  void sendIdentify(const std::shared_ptr<Link>& link);
  void onFindPeer(const std::shared_ptr<Link>& link, Reader& r);
  void onPeerInfo(Reader& r);
  void startDiscoveryLocked(Peer& peer);
  void dial(const std::string& address, const std::string& forPeer, const std::string& why);
  void dialFromDialer(const std::string& address);
  // Logs that d's connect() keeps failing (once per run of failures).
  void warnDialerLocked(Dialer& d, TimePoint now);
  // "; connect("ADDR") fails: ERROR" for the connect() addresses failing
  // now (logged too, if not yet), for a call that found no peer; else "".
  std::string failingDialersLocked(TimePoint now);
  void tick();
  std::shared_ptr<Link> bestLinkLocked(const Peer& peer) const;
  std::vector<std::string> advertisedLocked() const;
  // What to advertise to a peer on peerHost (mutex_ held).
  std::vector<std::string> addressesFor(const std::string& peerHost) const;
  // Listens on the transports that link upgrades need (shared memory; UCX
  // beside tcpAddress), as far as they are allowed and not listening yet.
  void ensureCompanionListenersLocked(const std::string& tcpAddress);
  void listenLocked(Context* ctx, const std::string& address);
  void warnIfExposedLocked(const std::string& address) const;
  // A link that reached this Rpc itself: its dialer (if connect() made it)
  // is dropped under the lock, then the link is closed, saying so once.
  std::string stopDialingSelfLocked(const std::shared_ptr<Link>& link);
  void closeLinkToSelf(const std::shared_ptr<Link>& link, const std::string& dialed);
  void maybeListenForPeersLocked(const std::shared_ptr<Link>& link);
  // Hostile connections (rpc_links.cc): accepted handshakes are capped in
  // all and per source address; the oldest are shed to make room.
  void listPendingLocked(const std::shared_ptr<Link>& link);
  void unlistPendingLocked(const std::shared_ptr<Link>& link);
  std::shared_ptr<Link> shedPendingLocked(const std::string& source);
  size_t relieveDescriptors();
  void logShedLocked(TimePoint now);  // at most once per second

  const uint64_t generation_;
  const std::string incarnation_;
  TransportSet contexts_;

  mutable std::mutex mutex_;
  std::string name_;
  std::string authKey_;
  double timeoutSeconds_ = 10.0;
  // The transports calls may use, and those set_transports() named (empty
  // until it is called): a transport that reaches a peer only when forced
  // counts when named there.
  std::set<std::string> transports_, forced_;
  bool closed_ = false;
  std::atomic<bool> started_{false};
  uint64_t tickTimer_ = 0;
  std::vector<std::unique_ptr<Listener>> listeners_;
  // Bound listen addresses by transport name, in the order they were made.
  std::map<std::string, std::vector<std::string>> listenAddresses_;
  // (transport, TCP address) pairs a companion listener was tried for.
  std::set<std::pair<std::string, std::string>> companions_;
  std::map<std::string, Dialer> dialers_;
  // Addresses being dialed for discovery or an upgrade, until the link's
  // handshake ends (see adopt).
  std::set<std::string> dialing_;
  std::map<std::string, TimePoint> failedDials_;  // address -> when to try it again
  std::set<std::shared_ptr<Link>> links_;
  // Nonces of our handshakes in progress: a peer presenting one is reflecting it.
  std::set<std::string> ownNonces_;
  std::map<std::string, Peer> peers_;
  // Accepted links still in their handshake, oldest first, and how many
  // come from each source address.
  std::list<std::shared_ptr<Link>> pendingIncoming_;
  std::map<std::string, size_t> pendingPerSource_;
  struct ShedStats {
    size_t crowded = 0, timedOut = 0;  // handshakes closed since the last summary
    std::set<std::string> sources;
    TimePoint lastLog{};
  } shed_;
  std::shared_ptr<void> descriptorRelief_;  // registered while it listens
  // The last authentication failure of a link this Rpc dialed, and why.
  TimePoint lastAuthFailure_{};
  std::string authFailure_;
  std::unordered_map<uint64_t, PendingCall> calls_;
  std::vector<std::pair<TimePoint, uint64_t>> deadlines_;  // min-heap of (deadline, call id)
  uint64_t nextCallId_ = 1;
  std::vector<std::weak_ptr<PeerLostHandler>> peerLostHandlers_;
  std::map<std::string, std::shared_ptr<Handler>> functions_;
  std::map<std::string, int> inFlight_;
  std::condition_variable inFlightCv_;
};

}  // namespace moolib
