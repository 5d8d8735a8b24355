// Links between peers: the handshake (hello, auth, identify), the peer table,
// discovery by name, keepalive and redialing.
#include <sys/resource.h>

#include <algorithm>
#include <utility>

#include "rpc/auth.h"
#include "rpc/rpc_state.h"
#include "runtime/host.h"
#include "runtime/logging.h"
#include "runtime/socket.h"
#include "transport/socket_listener.h"

namespace moolib {

namespace {

constexpr auto kTickInterval = std::chrono::milliseconds(100);
constexpr auto kKeepaliveInterval = std::chrono::seconds(1);
constexpr auto kKeepaliveTimeout = std::chrono::seconds(30);
constexpr auto kHandshakeTimeout = std::chrono::seconds(20);
constexpr auto kDiscoveryInterval = std::chrono::milliseconds(500);
constexpr auto kFailedDialBackoff = std::chrono::seconds(5);
// How long connect()'s address may keep failing before that is logged as an error.
constexpr auto kDialWarnAfter = std::chrono::seconds(10);
// Accepted connections still in their handshake: at most this many in all
// (fewer when the descriptor limit is low) and a quarter of that per source
// address. Past a cap the oldest is closed, not the newcomer: a legitimate
// peer completes its handshake in milliseconds, so idle connections, however
// many, cannot keep it out.
constexpr size_t kMaxPendingHandshakes = 1024;
constexpr size_t kMinPendingHandshakes = 32;
// Handshakes closed to make room are summarized at most this often.
constexpr auto kShedLogInterval = std::chrono::seconds(1);
// How many handshakes to close each time accept() runs out of descriptors.
constexpr size_t kReliefBatch = 16;
// A peer with no link and nothing queued is forgotten this long after its
// last link closed (a reconnection within it finds its entry as it was).
constexpr auto kForgetDepartedPeer = std::chrono::seconds(10);

const char* roleName(bool outgoing) { return outgoing ? "client" : "server"; }

void protocolError(const std::shared_ptr<Connection>& conn, const std::string& why) {
  MOO_LOG(kError, "closing connection from ", conn->remoteAddress(), " (", conn->transport(),
          "): ", why);
  conn->close(Error(why));
}

// Never hand a loopback or host-local (shared-memory) address to a peer on
// another host.
void dropHostLocal(std::vector<std::string>& addresses) {
  addresses.erase(std::remove_if(addresses.begin(), addresses.end(), &isHostLocalAddress),
                  addresses.end());
}

// Leaves room under the descriptor limit for established links and for
// whatever else the process has open.
size_t pendingHandshakeCap() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) {
    return kMaxPendingHandshakes;
  }
  return std::clamp<size_t>(rl.rlim_cur / 4, kMinPendingHandshakes, kMaxPendingHandshakes);
}

// The host a connection came from; all local shared-memory connections count
// as one source.
std::string sourceOf(const Connection& conn) {
  std::string remote = hostPortOf(conn.remoteAddress());
  auto colon = remote.rfind(':');
  if (colon == std::string::npos) return conn.transport();
  return remote.substr(0, colon);
}

}  // namespace

void Rpc::listPendingLocked(const std::shared_ptr<Link>& link) {
  link->pendingPos = pendingIncoming_.insert(pendingIncoming_.end(), link);
  link->pendingListed = true;
  ++pendingPerSource_[link->source];
}

void Rpc::unlistPendingLocked(const std::shared_ptr<Link>& link) {
  if (!link->pendingListed) return;
  link->pendingListed = false;
  pendingIncoming_.erase(link->pendingPos);
  auto it = pendingPerSource_.find(link->source);
  if (it != pendingPerSource_.end() && --it->second == 0) pendingPerSource_.erase(it);
}

std::shared_ptr<Rpc::Link> Rpc::shedPendingLocked(const std::string& source) {
  // From the given source, else from the source holding the most handshakes:
  // many addresses with few connections each keep theirs.
  std::string from = source;
  if (from.empty()) {
    size_t most = 0;
    for (auto& [s, n] : pendingPerSource_) {
      if (n > most) {
        most = n;
        from = s;
      }
    }
  }
  for (auto& l : pendingIncoming_) {
    if (l->source != from) continue;
    auto victim = l;  // the list is in arrival order: this is the oldest
    unlistPendingLocked(victim);
    ++shed_.crowded;
    shed_.sources.insert(from);
    return victim;
  }
  return nullptr;
}

size_t Rpc::relieveDescriptors() {
  std::vector<std::shared_ptr<Link>> victims;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    while (victims.size() < kReliefBatch) {
      auto victim = shedPendingLocked("");
      if (!victim) break;
      victims.push_back(std::move(victim));
    }
  }
  for (auto& v : victims) v->conn->close(Error("out of descriptors: handshake closed"));
  return victims.size();
}

void Rpc::logShedLocked(TimePoint now) {
  if (!shed_.crowded && !shed_.timedOut) return;
  if (now - shed_.lastLog < kShedLogInterval) return;
  size_t cap = pendingHandshakeCap();
  MOO_LOG(kError, "closed ", shed_.crowded + shed_.timedOut, " pending handshakes from ",
          shed_.sources.size(), shed_.sources.size() == 1 ? " address" : " addresses", " (",
          shed_.crowded, " to make room for newer connections: at most ", cap, " in handshake, ",
          cap / 4, " per address; ", shed_.timedOut,
          " timed out); the remote ends connected but did not complete the handshake");
  shed_.crowded = shed_.timedOut = 0;
  shed_.sources.clear();
  shed_.lastLog = now;
}

void Rpc::adopt(ConnectionPtr conn, bool outgoing, const std::string& dialAddress,
                const std::string& why, const std::string& dialing) {
  auto link = std::make_shared<Link>();
  link->conn = conn;
  link->outgoing = outgoing;
  link->dialAddress = dialAddress;
  link->dialing = dialing;
  link->why = !why.empty()           ? why
              : !dialAddress.empty() ? concat("connect(\"", dialAddress, "\")")
              : outgoing             ? "dialed"
                                     : "accepted";
  link->myNonce = makeNonce();
  if (!outgoing) link->source = sourceOf(*conn);
  bool hasKey;
  std::shared_ptr<Link> shed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) {
      dialing_.erase(dialing);
      conn->close(Error("the Rpc was closed"));
      return;
    }
    if (!outgoing) {
      size_t cap = pendingHandshakeCap();
      auto it = pendingPerSource_.find(link->source);
      if (it != pendingPerSource_.end() && it->second >= cap / 4) {
        shed = shedPendingLocked(link->source);
      } else if (pendingIncoming_.size() >= cap) {
        shed = shedPendingLocked("");
      }
      listPendingLocked(link);
      if (!descriptorRelief_) {
        std::weak_ptr<Rpc> weak = weak_from_this();
        descriptorRelief_ = addDescriptorRelief([weak]() -> size_t {
          auto self = weak.lock();
          return self ? self->relieveDescriptors() : 0;
        });
      }
    }
    links_.insert(link);
    ownNonces_.insert(link->myNonce);
    hasKey = !authKey_.empty();
  }
  if (shed) shed->conn->close(Error("too many connections in handshake: closed the oldest"));
  // Our hello goes out before the connection starts delivering frames: once
  // the peer's hello is handled we may send identify, which must follow it.
  Writer w;
  w.u8(kWireVersion);
  w.str(link->myNonce);
  w.u8(outgoing ? 0 : 1);
  w.u8(hasKey ? 1 : 0);
  w.str(hostIdentity());
  conn->send(OutgoingFrame{FrameType::kHello, w.take(), {}});
  std::weak_ptr<Rpc> weak = weak_from_this();
  std::weak_ptr<Link> weakLink = link;
  conn->start(
      [weak, weakLink](IncomingFrame&& frame) {
        auto self = weak.lock();
        auto l = weakLink.lock();
        if (self && l) self->onFrame(l, std::move(frame));
      },
      [weak, link](const Error& error) {
        if (auto self = weak.lock()) self->onLinkClosed(link, error);
      });
}

void Rpc::onFrame(const std::shared_ptr<Link>& link, IncomingFrame&& frame) {
  link->lastReceived = Clock::now();
  try {
    Reader r(frame.meta);
    if (link->state != Link::State::kReady) {
      if (!frame.segments.empty())
        return protocolError(link->conn, "payload before the handshake completed");
      switch (frame.type) {
        case FrameType::kHello:
          return onHello(link, r);
        case FrameType::kAuth:
          return onAuth(link, r);
        case FrameType::kIdentify:
          return onIdentify(link, r);
        default:
          return protocolError(link->conn, concat("frame type ", int(frame.type),
                                                  " before the handshake completed"));
      }
    }
    switch (frame.type) {
      case FrameType::kRequest:
        return onRequest(link, frame);
      case FrameType::kResponse:
        return onResponse(frame);
      case FrameType::kKeepalive:
        return;
      case FrameType::kFindPeer:
        return onFindPeer(link, r);
      case FrameType::kPeerInfo:
        return onPeerInfo(r);
      default:
        return protocolError(link->conn, concat("unexpected frame type ", int(frame.type)));
    }
  } catch (const WireError& e) {
    protocolError(link->conn, e.what());
  }
}

void Rpc::onHello(const std::shared_ptr<Link>& link, Reader& r) {
  if (link->state != Link::State::kHello) return protocolError(link->conn, "repeated hello");
  uint8_t version = r.u8();
  std::string nonce = r.str(64);
  uint8_t role = r.u8();
  bool peerHasKey = r.u8() != 0;
  // Known before identify, so that we never tell a peer on another host
  // addresses only this host can use.
  link->peerHost = r.str(256);
  if (version != kWireVersion)
    return protocolError(link->conn, concat("peer speaks protocol version ", int(version)));
  if (nonce.size() != kNonceBytes) return protocolError(link->conn, "bad nonce");
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (ownNonces_.count(nonce)) {
      // Our own hello came back. From a link of ours that goes the other way,
      // this Rpc reached itself (connect() given one of its own addresses);
      // anything else is a reflection.
      auto other = std::find_if(links_.begin(), links_.end(),
                                [&](const auto& l) { return l->myNonce == nonce; });
      if (other == links_.end() || (*other)->outgoing == link->outgoing)
        return protocolError(link->conn, "peer replayed one of our own nonces");
      std::string dialed = stopDialingSelfLocked(link);
      lock.unlock();
      return closeLinkToSelf(link, dialed);
    }
  }
  if (role != (link->outgoing ? 1 : 0))
    return protocolError(link->conn, "both ends claim the same role");
  link->peerNonce = nonce;
  std::string key;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    key = authKey_;
  }
  if (!key.empty() && !peerHasKey) {
    std::string why = "authentication required, but the peer has no key (set MOOLIB_AUTH_KEY)";
    noteAuthFailure(link, why);
    return protocolError(link->conn, why);
  }
  if (key.empty() && peerHasKey) {
    std::string why =
        "the peer requires authentication and this process has no key "
        "(set MOOLIB_AUTH_KEY or moolib.set_auth_key)";
    noteAuthFailure(link, why);
    return protocolError(link->conn, why);
  }
  if (key.empty()) {
    link->state = Link::State::kIdentify;
    sendIdentify(link);
    return;
  }
  link->state = Link::State::kAuth;
  if (link->outgoing) {
    Writer w;
    w.str(authProof(key, roleName(true), link->peerNonce, link->myNonce));
    link->conn->send(OutgoingFrame{FrameType::kAuth, w.take(), {}});
  }
}

void Rpc::onAuth(const std::shared_ptr<Link>& link, Reader& r) {
  if (link->state != Link::State::kAuth)
    return protocolError(link->conn, "unexpected authentication frame");
  std::string proof = r.str(128);
  std::string key;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    key = authKey_;
  }
  std::string expected = authProof(key, roleName(!link->outgoing), link->myNonce, link->peerNonce);
  if (!constantTimeEqual(proof, expected)) {
    std::string why = "authentication failed: the peer's key does not match";
    noteAuthFailure(link, why);
    return protocolError(link->conn, why);
  }
  if (!link->outgoing) {
    Writer w;
    w.str(authProof(key, roleName(false), link->peerNonce, link->myNonce));
    link->conn->send(OutgoingFrame{FrameType::kAuth, w.take(), {}});
  }
  link->state = Link::State::kIdentify;
  sendIdentify(link);
}

void Rpc::sendIdentify(const std::shared_ptr<Link>& link) {
  Writer w;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    maybeListenForPeersLocked(link);
    w.str(name_);
    w.str(incarnation_);
    w.str(hostIdentity());
    w.strings(addressesFor(link->peerHost));
    // Appended after the original fields: a reader that stops before them
    // (an older peer) still parses the frame.
    w.strings(contexts_.domains());
  }
  link->conn->send(OutgoingFrame{FrameType::kIdentify, w.take(), {}});
}

void Rpc::onIdentify(const std::shared_ptr<Link>& link, Reader& r) {
  if (link->state != Link::State::kIdentify)
    return protocolError(link->conn, "identify before authentication");
  link->peerName = r.str(1024);
  link->peerIncarnation = r.str(64);
  link->peerHost = r.str(256);
  link->peerAddresses = r.strings(256);
  if (r.remaining() > 0) {
    for (auto& d : r.strings(64)) {
      if (d.size() > 2048) return protocolError(link->conn, "oversized transport domain");
      link->peerDomains.emplace(d.substr(0, d.find('=')),
                                d.find('=') == std::string::npos ? "" : d.substr(d.find('=') + 1));
    }
    link->peerReported = true;
  }
  if (link->peerName.empty()) return protocolError(link->conn, "peer sent an empty name");
  link->conn->setHandshaken();
  std::vector<std::shared_ptr<Link>> stale;
  std::vector<QueuedCall> flush;
  std::shared_ptr<Link> target;
  std::string upgrade, upgradeWhy;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    ownNonces_.erase(link->myNonce);
    unlistPendingLocked(link);
    if (closed_) return;
    if (link->peerName == name_) {
      if (link->peerIncarnation == incarnation_) {
        std::string dialed = stopDialingSelfLocked(link);
        lock.unlock();
        return closeLinkToSelf(link, dialed);
      }
      MOO_LOG(kError, "a peer at ", link->conn->remoteAddress(), " uses our own name '", name_,
              "'");
      link->conn->close(Error("duplicate peer name"));
      return;
    }
    link->state = Link::State::kReady;
    if (!link->dialing.empty()) dialing_.erase(std::exchange(link->dialing, {}));
    Peer& p = peers_[link->peerName];
    p.name = link->peerName;
    if (!p.incarnation.empty() && p.incarnation != link->peerIncarnation) {
      // The peer restarted under the same name: its old links are dead weight.
      stale = std::move(p.links);
      p.links.clear();
    }
    p.incarnation = link->peerIncarnation;
    p.host = link->peerHost;
    p.addresses = link->peerAddresses;
    p.domains = link->peerDomains;
    p.reported = link->peerReported;
    p.links.push_back(link);
    target = bestLinkLocked(p);
    if (target) {
      flush = std::move(p.queued);
      p.queued.clear();
      for (auto& q : flush) {
        auto it = calls_.find(q.id);
        if (it != calls_.end()) {
          it->second.sent = true;
          it->second.incarnation = p.incarnation;
        }
      }
    }
    if (link->outgoing) {
      // The dialing side upgrades: when the registry prefers another
      // transport for this peer than the link's, it dials the peer's address
      // of that transport (shared memory on one host, UCX between hosts with
      // RDMA devices or where set_transports names it).
      TransportChoice choice = contexts_.choose(peerTransportsLocked(p.host, p.domains, p.reported),
                                                transports_, forced_);
      if (choice.context && contexts_.priority(choice.context->name()) >
                                contexts_.priority(link->conn->transport())) {
        std::string best = choice.context->name();
        bool have = std::any_of(p.links.begin(), p.links.end(),
                                [&](auto& l) { return best == l->conn->transport(); });
        for (auto& a : p.addresses) {
          if (!have && choice.context->handles(a) && transportOfAddress(a) == best &&
              !dialing_.count(a)) {
            upgrade = a;
            upgradeWhy = "upgrade: " + choice.why;
            dialing_.insert(a);
            break;
          }
        }
      }
    }
  }
  MOO_LOG(kInfo, "connected to peer '", link->peerName, "' over ", link->conn->transport(), " (",
          link->conn->remoteAddress(), ")");
  for (auto& s : stale) s->conn->close(Error("peer restarted"));
  for (auto& q : flush) sendRequest(target, q.id, q.function, std::move(q.segments));
  if (!upgrade.empty()) dial(upgrade, link->peerName, upgradeWhy);
}

std::string Rpc::stopDialingSelfLocked(const std::shared_ptr<Link>& link) {
  // An address of our own never leads anywhere else while we hold it.
  if (!link->outgoing || link->dialAddress.empty()) return "";
  if (!dialers_.erase(link->dialAddress)) return "";
  return link->dialAddress;
}

void Rpc::closeLinkToSelf(const std::shared_ptr<Link>& link, const std::string& dialed) {
  // Giving every peer the same list of addresses, its own among them, is a
  // common way to connect a group: one line says so, the rest is quiet.
  if (!dialed.empty()) {
    MOO_LOG(kError, "connect(\"", dialed, "\") reached this Rpc itself: an address of its own; ",
            "not dialing it again");
  } else {
    MOO_LOG(kVerbose, "closing a link from this Rpc to itself (", link->conn->remoteAddress(), ")");
  }
  link->conn->close(Error("connected to itself"));
}

void Rpc::maybeListenForPeersLocked(const std::shared_ptr<Link>& link) {
  // A peer that only dialed out must still be reachable by name: other peers
  // find it through discovery and dial it directly. So on its first outgoing
  // TCP link it listens on the interface that link uses (loopback stays
  // loopback), before telling the other side its addresses.
  // Also where set_transports() left TCP out but names a transport that
  // listens beside it (ucx): peers reach this one over TCP, then upgrade.
  Context* tcp = contexts_.bootstrap();
  if (!link->outgoing || !tcp) return;
  std::string name = tcp->name();
  bool wanted =
      allowed(name) || std::any_of(transports_.begin(), transports_.end(),
                                   [&](const std::string& t) { return !contexts_.hostLocal(t); });
  if (link->conn->transport() != name || listenAddresses_.count(name) || !wanted) return;
  std::string local = link->conn->localAddress();
  auto colon = local.rfind(':');
  if (colon == std::string::npos) return;
  std::string address = local.substr(0, colon) + ":0";
  try {
    std::weak_ptr<Rpc> weak = weak_from_this();
    auto l = tcp->listen(address, [weak](ConnectionPtr conn) {
      if (auto self = weak.lock()) self->adopt(std::move(conn), false, "");
    });
    std::string bound = l->address();
    listenAddresses_[name].push_back(bound);
    MOO_LOG(kInfo, "listening on ", bound, " so that other peers can reach this one by name");
    warnIfExposedLocked(bound);
    listeners_.push_back(std::move(l));
    ensureCompanionListenersLocked(bound);
  } catch (const std::exception& e) {
    MOO_LOG(kInfo, "could not listen on ", address, ": ", e.what());
  }
}

void Rpc::noteAuthFailure(const std::shared_ptr<Link>& link, const std::string& why) {
  if (!link->outgoing) return;  // the dialer's calls are the dialer's business
  std::lock_guard<std::mutex> lock(mutex_);
  if (link->authRefused || closed_) return;
  link->authRefused = true;
  lastAuthFailure_ = Clock::now();
  authFailure_ = concat(link->conn->remoteAddress(), ": ", why);
}

void Rpc::onLinkClosed(const std::shared_ptr<Link>& link, const Error& error) {
  // The dialing side sends its proof first; a peer that does not accept it
  // closes the link without a word.
  if (link->state == Link::State::kAuth) {
    noteAuthFailure(link, "the peer closed the connection during authentication: its key differs");
  }
  std::vector<PendingCall> lost;
  std::vector<std::shared_ptr<PeerLostHandler>> peerLost;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    links_.erase(link);
    ownNonces_.erase(link->myNonce);
    if (!link->dialing.empty()) dialing_.erase(std::exchange(link->dialing, {}));
    unlistPendingLocked(link);
    if (link->state == Link::State::kReady) {
      auto it = peers_.find(link->peerName);
      if (it != peers_.end()) {
        auto& v = it->second.links;
        v.erase(std::remove(v.begin(), v.end(), link), v.end());
        if (v.empty()) it->second.idleSince = Clock::now();
        // The callee answers over any link to it: a call fails only once
        // that incarnation of the peer has none left.
        bool linked = std::any_of(v.begin(), v.end(), [&](const std::shared_ptr<Link>& l) {
          return l->peerIncarnation == link->peerIncarnation && !l->conn->closed();
        });
        if (!linked) takeCallsToLocked(link->peerName, link->peerIncarnation, lost);
        bool any = std::any_of(v.begin(), v.end(),
                               [](const std::shared_ptr<Link>& l) { return !l->conn->closed(); });
        if (!any && !link->silent && !closed_) {
          for (auto& weak : peerLostHandlers_) {
            if (auto h = weak.lock()) peerLost.push_back(std::move(h));
          }
        }
      }
    }
    if (!link->dialAddress.empty()) {
      auto d = dialers_.find(link->dialAddress);
      if (d != dialers_.end()) {
        d->second.active = false;
        d->second.nextAttempt = Clock::now() + std::chrono::milliseconds(100);
      }
    }
  }
  if (link->state == Link::State::kReady) {
    MOO_LOG(kInfo, "link to peer '", link->peerName, "' (", link->conn->transport(),
            ") closed: ", error.what());
  }
  for (auto& h : peerLost) (*h)(link->peerName);
  for (auto& c : lost) {
    c.future->setError(Error(ErrorCode::kConnectionLost,
                             concat("call to peer '", c.peer, "' function '", c.function,
                                    "' failed: the connection was lost (", error.what(), ")")));
  }
}

std::shared_ptr<void> Rpc::onPeerLost(PeerLostHandler handler) {
  auto held = std::make_shared<PeerLostHandler>(std::move(handler));
  std::lock_guard<std::mutex> lock(mutex_);
  // Dropped tokens are pruned here, so the list stays as long as the live ones.
  peerLostHandlers_.erase(std::remove_if(peerLostHandlers_.begin(), peerLostHandlers_.end(),
                                         [](const auto& w) { return w.expired(); }),
                          peerLostHandlers_.end());
  peerLostHandlers_.push_back(held);
  return held;
}

bool Rpc::linkedTo(const std::string& peer) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = peers_.find(peer);
  return it != peers_.end() &&
         std::any_of(it->second.links.begin(), it->second.links.end(),
                     [](const std::shared_ptr<Link>& l) { return !l->conn->closed(); });
}

std::shared_ptr<Rpc::Link> Rpc::bestLinkLocked(const Peer& peer) const {
  // The allowed link of the highest priority transport; the oldest among equals.
  std::shared_ptr<Link> best;
  int bestPriority = 0;
  for (auto& l : peer.links) {
    if (l->conn->closed() || !allowed(l->conn->transport())) continue;
    int priority = contexts_.priority(l->conn->transport());
    if (!best || priority > bestPriority) {
      best = l;
      bestPriority = priority;
    }
  }
  return best;
}

std::vector<std::string> Rpc::addressesFor(const std::string& peerHost) const {
  std::vector<std::string> addresses = advertisedLocked();
  if (peerHost != hostIdentity()) dropHostLocal(addresses);
  return addresses;
}

std::vector<std::string> Rpc::advertisedLocked() const {
  // Highest priority transport first; TCP (the bootstrap) always, the others
  // while allowed. A wildcard host stands for every interface.
  std::vector<std::string> out;
  auto add = [&](const std::string& transport, const std::vector<std::string>& addresses) {
    bool host = !contexts_.hostLocal(transport);
    for (auto& a : addresses) {
      std::string hostPort = hostPortOf(a);
      std::string scheme = a.substr(0, a.size() - hostPort.size());
      SockAddr addr;
      try {
        if (!host) throw Exception("");
        addr = parseTcpAddress(hostPort);
      } catch (const Exception&) {
        out.push_back(a);
        continue;
      }
      if (!isWildcardAddress(addr)) {
        out.push_back(a);
        continue;
      }
      std::string port = hostPort.substr(hostPort.rfind(':') + 1);
      for (auto& h : interfaceAddresses()) {
        out.push_back(scheme + h + ":" + port);
      }
      out.push_back(scheme + "127.0.0.1:" + port);
    }
  };
  for (auto* ctx : contexts_.byPriority()) {
    std::string name = ctx->name();
    auto it = listenAddresses_.find(name);
    if (it == listenAddresses_.end()) continue;
    if (name != kBootstrapTransport && !allowed(name)) continue;
    add(name, it->second);
  }
  return out;
}

void Rpc::startDiscoveryLocked(Peer& peer) {
  auto now = Clock::now();
  if (now < peer.nextDiscovery) return;
  peer.nextDiscovery = now + kDiscoveryInterval;
  Writer w;
  w.str(peer.name);
  std::string meta = w.take();
  for (auto& l : links_) {
    if (l->state == Link::State::kReady && l->peerName != peer.name) {
      l->conn->send(OutgoingFrame{FrameType::kFindPeer, meta, {}});
    }
  }
}

void Rpc::onFindPeer(const std::shared_ptr<Link>& link, Reader& r) {
  std::string wanted = r.str(1024);
  Writer w;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string incarnation, host;
    std::vector<std::string> addresses;
    bool found = false;
    if (wanted == name_) {
      found = true;
      incarnation = incarnation_;
      host = hostIdentity();
      addresses = advertisedLocked();
    } else if (auto it = peers_.find(wanted); it != peers_.end() && !it->second.links.empty()) {
      found = true;
      incarnation = it->second.incarnation;
      host = it->second.host;
      addresses = it->second.addresses;
    }
    if (found && host != link->peerHost) dropHostLocal(addresses);
    w.u8(found ? 1 : 0);
    w.str(wanted);
    w.str(incarnation);
    w.str(host);
    w.strings(addresses);
  }
  link->conn->send(OutgoingFrame{FrameType::kPeerInfo, w.take(), {}});
}

void Rpc::onPeerInfo(Reader& r) {
  bool found = r.u8() != 0;
  std::string name = r.str(1024);
  std::string incarnation = r.str(64);
  std::string host = r.str(256);
  std::vector<std::string> addresses = r.strings(256);
  if (!found) return;
  std::string chosen, why;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = peers_.find(name);
    if (it == peers_.end() || bestLinkLocked(it->second) || it->second.queued.empty()) return;
    bool local = host == hostIdentity();
    auto now = Clock::now();
    // Addresses that failed lately are skipped, so that each discovery round
    // tries the next one (a host often has interfaces the asker cannot route to).
    auto failed = [&](const std::string& a) {
      auto f = failedDials_.find(a);
      return f != failedDials_.end() && f->second > now;
    };
    // What the peer's host alone tells (its transports' domains come with
    // its identify): shared memory on the same host. Otherwise a bootstrap
    // (TCP) address; the link upgrades once the peer has identified itself.
    TransportChoice choice =
        contexts_.choose(peerTransportsLocked(host, {}, false), transports_, forced_);
    for (auto& a : addresses) {
      if (dialing_.count(a)) return;  // already on its way
      if (choice.context && choice.context->name() != std::string(kBootstrapTransport) &&
          transportOfAddress(a) == choice.context->name() && !failed(a)) {
        chosen = a;
        why = "found by name: " + choice.why;
        break;
      }
    }
    if (chosen.empty()) {
      for (auto& a : addresses) {
        if (transportOfAddress(a) != kBootstrapTransport || (!local && isHostLocalAddress(a)) ||
            failed(a))
          continue;
        chosen = a;
        why = "found by name";
        break;
      }
    }
    if (chosen.empty()) return;
    dialing_.insert(chosen);
  }
  dial(chosen, name, why);
}

void Rpc::dial(const std::string& address, const std::string& forPeer, const std::string& why) {
  std::weak_ptr<Rpc> weak = weak_from_this();
  Context* ctx;
  try {
    ctx = contextFor(address);
  } catch (const Exception&) {
    std::lock_guard<std::mutex> lock(mutex_);
    dialing_.erase(address);
    return;
  }
  ctx->connect(address, [weak, address, forPeer, why](const Error& error, ConnectionPtr conn) {
    auto self = weak.lock();
    if (!self) {
      if (conn) conn->close(Error("the Rpc is gone"));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      if (error) {
        self->dialing_.erase(address);
        self->failedDials_[address] = Clock::now() + kFailedDialBackoff;
      } else {
        self->failedDials_.erase(address);
      }
    }
    if (error) {
      MOO_LOG(kVerbose, "cannot reach peer '", forPeer, "' at ", address, ": ", error.what());
      return;
    }
    // The address stays in dialing_ until the handshake ends: a discovery
    // round meanwhile (the tick's, every kDiscoveryInterval) would dial the
    // peer again, and a slow handshake (a loaded host) would pile up links.
    self->adopt(std::move(conn), true, "", why, address);
  });
}

void Rpc::dialFromDialer(const std::string& address) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = dialers_.find(address);
    if (it == dialers_.end() || it->second.active || closed_) return;
    it->second.active = true;
  }
  std::weak_ptr<Rpc> weak = weak_from_this();
  contextFor(address)->connect(address, [weak, address](const Error& error, ConnectionPtr conn) {
    auto self = weak.lock();
    if (!self) {
      if (conn) conn->close(Error("the Rpc is gone"));
      return;
    }
    if (!error) {
      std::lock_guard<std::mutex> lock(self->mutex_);
      auto it = self->dialers_.find(address);
      if (it != self->dialers_.end()) {
        it->second.failures = 0;
        it->second.warned = false;
        it->second.lastError.clear();
      }
    }
    if (error) {
      std::lock_guard<std::mutex> lock(self->mutex_);
      auto it = self->dialers_.find(address);
      if (it == self->dialers_.end()) return;
      Dialer& d = it->second;
      auto now = Clock::now();
      if (d.failures == 0) d.failingSince = now;
      d.active = false;
      d.failures = std::min(d.failures + 1, 5);
      d.nextAttempt = now + std::chrono::milliseconds(100 << (d.failures - 1));
      d.lastError = error.what();
      // Peers often start before what they connect to, so early failures are
      // normal; one that lasts is most likely a wrong address or a dead peer.
      // (A call that finds no peer meanwhile says so at once: expireCalls.)
      if (!d.warned && now - d.failingSince >= kDialWarnAfter) {
        self->warnDialerLocked(d, now);
      } else {
        MOO_LOG(kVerbose, "connect to ", address, " failed (will retry): ", error.what());
      }
      return;
    }
    self->adopt(std::move(conn), true, address);
  });
}

void Rpc::warnDialerLocked(Dialer& d, TimePoint now) {
  d.warned = true;
  MOO_LOG(
      kError, "connect(\"", d.address, "\"): no link after ",
      std::chrono::duration_cast<std::chrono::milliseconds>(now - d.failingSince).count() / 1000.0,
      " s, still trying; last error: ", d.lastError);
}

std::string Rpc::failingDialersLocked(TimePoint now) {
  // Each one is likely the peer a call waited for: a wrong address, or a
  // peer not started. A few are named; the log has them all.
  constexpr int kNamed = 3;
  std::string text;
  int named = 0;
  for (auto& [address, d] : dialers_) {
    if (!d.failures) continue;
    if (named++ < kNamed) {
      text += concat("; connect(\"", address, "\") fails: ", d.lastError);
    }
    if (!d.warned) warnDialerLocked(d, now);
  }
  if (named > kNamed) text += concat(" (and ", named - kNamed, " more connect() addresses)");
  return text;
}

void Rpc::tick() {
  auto now = Clock::now();
  expireCalls(now);
  std::vector<std::string> redial;
  std::vector<std::shared_ptr<Link>> keepalive, dead, stalled;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    for (auto& [address, d] : dialers_) {
      if (!d.active && now >= d.nextAttempt) redial.push_back(address);
    }
    for (auto it = failedDials_.begin(); it != failedDials_.end();) {
      it = it->second <= now ? failedDials_.erase(it) : std::next(it);
    }
    for (auto& l : links_) {
      if (l->state != Link::State::kReady) {
        if (now - l->created > kHandshakeTimeout && !l->conn->closed()) {
          if (l->pendingListed) {
            // Summarized below rather than one line each: a flood of idle
            // connections would otherwise flood the log as well.
            unlistPendingLocked(l);
            ++shed_.timedOut;
            shed_.sources.insert(l->source);
            stalled.push_back(l);
          } else {
            dead.push_back(l);
          }
        }
        continue;
      }
      if (now - l->lastReceived.load() > kKeepaliveTimeout) {
        l->silent = true;
        dead.push_back(l);
        continue;
      }
      uint64_t sent = l->conn->bytesSent();
      if (sent != l->lastBytesSent) {
        l->lastBytesSent = sent;
        l->lastSendCheck = now;
      } else if (now - l->lastSendCheck >= kKeepaliveInterval) {
        l->lastSendCheck = now;
        keepalive.push_back(l);
      }
    }
    for (auto it = peers_.begin(); it != peers_.end();) {
      Peer& p = it->second;
      if (!p.queued.empty() && !bestLinkLocked(p)) startDiscoveryLocked(p);
      bool departed = p.incarnation.empty() || now - p.idleSince >= kForgetDepartedPeer;
      if (p.links.empty() && p.queued.empty() && departed) {
        it = peers_.erase(it);
      } else {
        ++it;
      }
    }
    logShedLocked(now);
    std::weak_ptr<Rpc> weak = weak_from_this();
    tickTimer_ = Loop::instance().addTimer(now + kTickInterval, [weak] {
      if (auto self = weak.lock()) self->tick();
    });
  }
  for (auto& l : dead) {
    protocolError(l->conn, l->state == Link::State::kReady
                               ? "no traffic within the keepalive timeout"
                               : "handshake timed out");
  }
  for (auto& l : stalled) l->conn->close(Error("handshake timed out"));
  for (auto& l : keepalive) l->conn->send(OutgoingFrame{FrameType::kKeepalive, {}, {}});
  for (auto& a : redial) dialFromDialer(a);
}

}  // namespace moolib
