#include <algorithm>
#include <cstdlib>

#include "rpc/rpc_state.h"
#include "runtime/host.h"
#include "runtime/logging.h"
#include "runtime/socket.h"
#include "transport/burst.h"

namespace moolib {

namespace {

// The function a pool thread is running, so undefine() from inside it does not
// wait for itself.
thread_local const Rpc* tlsRpc = nullptr;
thread_local const std::string* tlsFunction = nullptr;

}  // namespace

void Rpc::runHandler(const Rpc& rpc, const Handler& handler, std::shared_ptr<Responder> responder,
                     const std::string& function, std::vector<BufferPtr> args) {
  tlsRpc = &rpc;
  tlsFunction = &function;
  std::shared_ptr<Responder> keep = responder;
  try {
    handler(std::move(responder), std::move(args));
  } catch (const std::exception& e) {
    keep->error(e.what());
  }
  tlsRpc = nullptr;
  tlsFunction = nullptr;
}

Responder::Responder(std::weak_ptr<Rpc> rpc, std::string peer, std::weak_ptr<Connection> conn,
                     uint64_t callId, std::string function, FuturePtr local)
    : rpc_(std::move(rpc)),
      peer_(std::move(peer)),
      conn_(std::move(conn)),
      callId_(callId),
      function_(std::move(function)),
      local_(std::move(local)) {}

Responder::~Responder() {
  if (!answered_) error(concat("function '", function_, "' returned without replying"));
}

void Responder::reply(std::vector<OutSegment> segments) {
  send(ErrorCode::kOk, {}, std::move(segments));
}

void Responder::error(const std::string& message, ErrorCode code) {
  send(code == ErrorCode::kOk ? ErrorCode::kRemoteException : code, message, {});
}

void Responder::send(ErrorCode status, const std::string& error, std::vector<OutSegment> segments) {
  if (answered_.exchange(true)) return;
  auto rpc = rpc_.lock();
  if (local_) {
    if (status == ErrorCode::kOk) {
      std::vector<BufferPtr> copies;
      for (auto& s : segments) copies.push_back(copyToBuffer(s));
      local_->setResult(std::move(copies));
    } else {
      local_->setError(Error(status, concat("remote function '", function_, "' on peer '", peer_,
                                            "' raised ", error)));
    }
    if (rpc) rpc->finishCall(function_);
    return;
  }
  if (!rpc) return;
  Writer w;
  w.u64(callId_);
  w.u8(uint8_t(status));
  w.str(error);
  rpc->sendResponse(peer_, conn_,
                    OutgoingFrame{FrameType::kResponse, w.take(), std::move(segments)});
  rpc->finishCall(function_);
}

std::shared_ptr<Rpc> Rpc::create() { return std::make_shared<Rpc>(); }

Rpc::Rpc() : generation_(Loop::generation()), incarnation_(randomHex(8)), name_(randomHex(8)) {
  Loop::instance();
  for (auto* c : contexts_.byPriority()) transports_.insert(c->name());
  if (const char* key = std::getenv("MOOLIB_AUTH_KEY")) authKey_ = key;
}

bool Rpc::inherited() const { return generation_ != Loop::generation(); }

Rpc::~Rpc() {
  if (inherited()) {
    // Forked child: this peer's threads and loop belong to the parent. Leave
    // every resource alone rather than touch the parent's loop.
    static auto* abandoned = new std::vector<std::shared_ptr<void>>();
    for (auto& l : links_) abandoned->push_back(l);
    for (auto& l : listeners_) abandoned->push_back(std::shared_ptr<Listener>(std::move(l)));
    for (auto& c : contexts_.release()) abandoned->push_back(std::move(c));
    listeners_.clear();
    return;
  }
  close();
}

void Rpc::checkUsable() const {
  MOO_ENFORCE(generation_ == Loop::generation(),
              "this Rpc was created before the process forked; create a new Rpc in the child");
  std::lock_guard<std::mutex> lock(mutex_);
  MOO_ENFORCE(!closed_, "this Rpc is closed");
}

void Rpc::ensureStarted() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (started_) return;
  started_ = true;
  std::weak_ptr<Rpc> weak = shared_from_this();
  tickTimer_ = Loop::instance().addTimer(Clock::now() + std::chrono::milliseconds(100), [weak] {
    if (auto self = weak.lock()) self->tick();
  });
}

bool Rpc::allowed(const std::string& transport) const { return transports_.count(transport) != 0; }

bool Rpc::transportAllowed(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return transports_.count(name) != 0;
}

Context* Rpc::contextFor(const std::string& address) { return contexts_.forAddress(address); }

PeerTransports Rpc::peerTransportsLocked(const std::string& host,
                                         const std::map<std::string, std::string>& domains,
                                         bool reported) const {
  PeerTransports pt;
  pt.sameHost = host == hostIdentity();
  pt.domains = domains;
  if (!reported) {
    // A peer that did not list its transports has what every peer has.
    pt.domains = assumedDomains(host);
  }
  return pt;
}

void Rpc::setName(const std::string& name) {
  MOO_ENFORCE(!name.empty() && name.size() <= 1024, "peer name must be 1 to 1024 characters");
  std::lock_guard<std::mutex> lock(mutex_);
  name_ = name;
}

std::string Rpc::name() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return name_;
}

std::string Rpc::listen(const std::string& address) {
  checkUsable();
  ensureStarted();
  std::weak_ptr<Rpc> weak = shared_from_this();
  Context* ctx = contextFor(address);
  auto listener = ctx->listen(address, [weak](ConnectionPtr conn) {
    if (auto self = weak.lock()) {
      self->adopt(std::move(conn), false, "");
    } else {
      conn->close(Error("the Rpc is gone"));
    }
  });
  std::string bound = listener->address();
  std::lock_guard<std::mutex> lock(mutex_);
  listenAddresses_[ctx->name()].push_back(bound);
  if (!ctx->hostLocal()) warnIfExposedLocked(hostPortOf(bound));
  listeners_.push_back(std::move(listener));
  ensureCompanionListenersLocked(ctx == contexts_.bootstrap() ? bound : "");
  return bound;
}

void Rpc::warnIfExposedLocked(const std::string& address) const {
  // Peers unpickle what they receive: an open port without a key runs code
  // for anyone who can reach it.
  if (authKey_.empty() && !isLoopbackHostPort(address)) {
    MOO_LOG(
        kError, "listening on ", address,
        " without an authentication key: anyone who can reach this address can run code in this "
        "process. Set MOOLIB_AUTH_KEY (or moolib.set_auth_key) on every peer.");
  }
}

void Rpc::listenLocked(Context* ctx, const std::string& address) {
  std::weak_ptr<Rpc> weak = weak_from_this();
  auto l = ctx->listen(address, [weak](ConnectionPtr conn) {
    if (auto self = weak.lock()) {
      self->adopt(std::move(conn), false, "");
    } else {
      conn->close(Error("the Rpc is gone"));
    }
  });
  listenAddresses_[ctx->name()].push_back(l->address());
  listeners_.push_back(std::move(l));
}

void Rpc::ensureCompanionListenersLocked(const std::string& tcpAddress) {
  for (auto* ctx : contexts_.byPriority()) {
    std::string name = ctx->name();
    if (!allowed(name) || (!tcpAddress.empty() && ctx->handles(tcpAddress))) continue;
    // A host-local transport needs one listener; one beside each TCP listener
    // for the others.
    auto key = std::make_pair(name, ctx->hostLocal() ? std::string() : tcpAddress);
    if (companions_.count(key) || (ctx->hostLocal() && listenAddresses_.count(name))) continue;
    std::string address = ctx->companionAddress(incarnation_, tcpAddress, forced_.count(name) != 0);
    if (address.empty()) continue;
    companions_.insert(key);
    try {
      listenLocked(ctx, address);
    } catch (const std::exception& e) {
      MOO_LOG(kError, "cannot listen on ", address, ": ", e.what());
    }
  }
}

void Rpc::connect(const std::string& address) {
  checkUsable();
  ensureStarted();
  // A malformed address never connects: say so here, not by retrying it forever.
  contextFor(address)->checkAddress(address);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ensureCompanionListenersLocked("");
    auto& d = dialers_[address];
    d.address = address;
  }
  dialFromDialer(address);
}

void Rpc::setTimeout(double seconds) {
  // Below 1e7 s: a deadline is kept in nanoseconds, which a far longer (or
  // infinite) timeout would overflow. moolib.Rpc refuses others first.
  MOO_ENFORCE(seconds > 0 && seconds < 1e7, "timeout must be positive and below 1e7 s, got ",
              seconds);
  std::lock_guard<std::mutex> lock(mutex_);
  timeoutSeconds_ = seconds;
}

double Rpc::timeout() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return timeoutSeconds_;
}

void Rpc::setTransports(const std::vector<std::string>& names) {
  std::set<std::string> chosen;
  for (auto& n : names) {
    std::string name = canonicalTransport(n);
    MOO_ENFORCE(!name.empty(), "unknown transport '", n, "' (known: ", knownTransports(), ")");
    if (!contexts_.get(name)) {
      for (auto& st : contexts_.status()) {
        MOO_ENFORCE(st.name != name, "transport ", name, " is not available here: ", st.why);
      }
    }
    chosen.insert(name);
  }
  MOO_ENFORCE(!chosen.empty(), "at least one transport is needed");
  std::lock_guard<std::mutex> lock(mutex_);
  transports_ = chosen;
  forced_ = chosen;
}

void Rpc::setAuthKey(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  authKey_ = key;
}

void Rpc::define(const std::string& name, Handler handler) {
  checkUsable();
  ensureStarted();
  MOO_ENFORCE(!name.empty() && name.size() <= 1024, "function name must be 1 to 1024 characters");
  std::lock_guard<std::mutex> lock(mutex_);
  MOO_ENFORCE(!functions_.count(name), "function '", name, "' is already defined");
  functions_[name] = std::make_shared<Handler>(std::move(handler));
}

bool Rpc::isDefined(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  return functions_.count(name) != 0;
}

void Rpc::undefine(const std::string& name) {
  std::unique_lock<std::mutex> lock(mutex_);
  MOO_ENFORCE(functions_.erase(name), "function '", name, "' is not defined");
  if (tlsRpc == this && tlsFunction && *tlsFunction == name) return;
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(timeoutSeconds_));
  inFlightCv_.wait_until(lock, deadline, [&] { return inFlight_[name] == 0; });
}

void Rpc::finishCall(const std::string& function) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = inFlight_.find(function);
  if (it != inFlight_.end() && --it->second <= 0) {
    inFlight_.erase(it);
    inFlightCv_.notify_all();
  }
}

FuturePtr Rpc::call(const std::string& peer, const std::string& function,
                    std::vector<OutSegment> segments, bool waitNext, double timeoutSeconds) {
  MOO_ENFORCE(generation_ == Loop::generation(),
              "this Rpc was created before the process forked; create a new Rpc in the child");
  if (!started_.load(std::memory_order_acquire)) ensureStarted();
  auto future = std::make_shared<FutureState>();
  std::unique_lock<std::mutex> lock(mutex_);
  MOO_ENFORCE(!closed_, "this Rpc is closed");
  uint64_t id = nextCallId_++;
  if (peer == name_) {
    lock.unlock();
    callLocal(future, id, function, segments);
    return future;
  }
  if (timeoutSeconds <= 0) timeoutSeconds = timeoutSeconds_;
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(timeoutSeconds));
  auto& pending = calls_[id];
  pending.peer = peer;
  pending.function = function;
  pending.timeoutSeconds = timeoutSeconds;
  pending.future = future;
  deadlines_.emplace_back(deadline, id);
  std::push_heap(deadlines_.begin(), deadlines_.end(), std::greater<>());
  Peer& p = peers_[peer];
  p.name = peer;
  auto link = bestLinkLocked(p);
  if (!link) {
    p.queued.push_back(QueuedCall{id, function, std::move(segments)});
    startDiscoveryLocked(p);
    return future;
  }
  pending.sent = true;
  pending.incarnation = p.incarnation;
  lock.unlock();
  future->setServe(link->conn, waitNext && link->conn->claim());
  SendBurst::WaitsNext urgent(waitNext);
  sendRequest(link, id, function, std::move(segments));
  return future;
}

void Rpc::sendRequest(const std::shared_ptr<Link>& link, uint64_t id, const std::string& function,
                      std::vector<OutSegment> segments) {
  Writer w;
  w.u64(id);
  w.str(function);
  link->conn->send(OutgoingFrame{FrameType::kRequest, w.take(), std::move(segments)});
}

void Rpc::callLocal(const FuturePtr& future, uint64_t id, const std::string& function,
                    std::vector<OutSegment>& segs) {
  std::shared_ptr<Handler> handler;
  std::string self;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = functions_.find(function);
    self = name_;
    if (it != functions_.end()) {
      handler = it->second;
      ++inFlight_[function];
    }
  }
  if (!handler) {
    future->setError(
        Error(ErrorCode::kNotDefined,
              concat("function '", function, "' is not defined on peer '", self, "'")));
    return;
  }
  std::vector<BufferPtr> args;
  for (auto& s : segs) args.push_back(copyToBuffer(s));
  auto responder = std::make_shared<Responder>(weak_from_this(), self, std::weak_ptr<Connection>(),
                                               id, function, future);
  std::weak_ptr<Rpc> weak = weak_from_this();
  Loop::instance().schedule([weak, handler, responder, function, args = std::move(args)]() mutable {
    auto rpc = weak.lock();
    if (!rpc) return;
    runHandler(*rpc, *handler, std::move(responder), function, std::move(args));
  });
}

void Rpc::onRequest(const std::shared_ptr<Link>& link, IncomingFrame& frame) {
  Reader r(frame.meta);
  uint64_t id = r.u64();
  std::string function = r.str(1024);
  std::shared_ptr<Handler> handler;
  std::string self;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    self = name_;
    auto it = functions_.find(function);
    if (it != functions_.end()) {
      handler = it->second;
      ++inFlight_[function];
    }
  }
  if (!handler) {
    Writer w;
    w.u64(id);
    w.u8(uint8_t(ErrorCode::kNotDefined));
    w.str(concat("function '", function, "' is not defined on peer '", self, "'"));
    link->conn->send(OutgoingFrame{FrameType::kResponse, w.take(), {}});
    return;
  }
  auto responder =
      std::make_shared<Responder>(weak_from_this(), link->peerName, link->conn, id, function);
  std::weak_ptr<Rpc> weak = weak_from_this();
  Loop::instance().schedule([weak, handler, responder, function = std::move(function),
                             args = std::move(frame.segments)]() mutable {
    auto rpc = weak.lock();
    if (!rpc) return;
    runHandler(*rpc, *handler, std::move(responder), function, std::move(args));
  });
}

void Rpc::sendResponse(const std::string& peer, const std::weak_ptr<Connection>& conn,
                       OutgoingFrame&& frame) {
  if (auto c = conn.lock(); c && !c->closed()) {
    c->send(std::move(frame));
    return;
  }
  std::shared_ptr<Link> link;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = peers_.find(peer);
    if (it != peers_.end()) link = bestLinkLocked(it->second);
  }
  if (link) {
    link->conn->send(std::move(frame));
  } else {
    MOO_LOG(kVerbose, "reply to peer '", peer, "' dropped: no link to it");
  }
}

void Rpc::onResponse(IncomingFrame& frame) {
  Reader r(frame.meta);
  uint64_t id = r.u64();
  ErrorCode status = errorCodeFromWire(r.u8());
  std::string error = r.str();
  PendingCall call;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = calls_.find(id);
    if (it == calls_.end()) return;  // timed out or cancelled meanwhile
    call = std::move(it->second);
    calls_.erase(it);
  }
  if (status == ErrorCode::kOk) {
    call.future->setResult(std::move(frame.segments));
  } else if (status == ErrorCode::kNotDefined) {
    call.future->setError(Error(status, error));
  } else {
    call.future->setError(Error(status, concat("remote function '", call.function, "' on peer '",
                                               call.peer, "' raised ", error)));
  }
}

void Rpc::expireCalls(TimePoint now) {
  struct Expired {
    PendingCall call;
    ErrorCode code;
    std::string why;
  };
  std::vector<Expired> expired;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // The heap holds every call's deadline; calls answered meanwhile are
    // skipped as their deadlines come up, so each tick costs only what expires.
    while (!deadlines_.empty() && deadlines_.front().first <= now) {
      uint64_t id = deadlines_.front().second;
      std::pop_heap(deadlines_.begin(), deadlines_.end(), std::greater<>());
      deadlines_.pop_back();
      auto it = calls_.find(id);
      if (it == calls_.end()) continue;
      PendingCall& c = it->second;
      std::string why;
      ErrorCode code = ErrorCode::kTimeout;
      auto p = peers_.find(c.peer);
      if (c.sent) {
        why = "no reply";
      } else if (p == peers_.end() || p->second.incarnation.empty()) {
        why = concat("peer '", c.peer, "' was not found");
      } else {
        why = concat("no link to peer '", c.peer, "'");
      }
      if (!c.sent) why += failingDialersLocked(now);
      // A peer not reached while links this Rpc dialed were refused at
      // authentication is most likely behind one of them. A refusal shortly
      // before the call counts: connect() is often called right before it.
      auto window = std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(c.timeoutSeconds));
      if (!c.sent && !authFailure_.empty() && lastAuthFailure_ + window >= c.created) {
        code = ErrorCode::kAuthenticationFailed;
        why +=
            concat("; a link this Rpc dialed was refused at authentication (", authFailure_, ")");
      }
      if (p != peers_.end()) {
        auto& q = p->second.queued;
        q.erase(
            std::remove_if(q.begin(), q.end(), [id](const QueuedCall& x) { return x.id == id; }),
            q.end());
      }
      expired.push_back(Expired{std::move(c), code, std::move(why)});
      calls_.erase(it);
    }
  }
  for (auto& e : expired) {
    e.call.future->setError(
        Error(e.code, concat("call to peer '", e.call.peer, "' function '", e.call.function,
                             "' timed out after ", e.call.timeoutSeconds, " seconds: ", e.why)));
  }
}

void Rpc::takeCallsToLocked(const std::string& peer, const std::string& incarnation,
                            std::vector<PendingCall>& out) {
  // Link closes are rare and calls in flight few: a scan costs less than an
  // index kept up to date on every call.
  for (auto it = calls_.begin(); it != calls_.end();) {
    PendingCall& c = it->second;
    if (c.sent && c.peer == peer && c.incarnation == incarnation) {
      out.push_back(std::move(c));
      it = calls_.erase(it);
    } else {
      ++it;
    }
  }
}

void Rpc::close() {
  std::vector<std::shared_ptr<Link>> links;
  std::vector<std::unique_ptr<Listener>> listeners;
  std::unordered_map<uint64_t, PendingCall> calls;
  std::map<std::string, std::shared_ptr<Handler>> functions;
  std::map<std::string, Peer> peers;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    closed_ = true;
    links.assign(links_.begin(), links_.end());
    links_.clear();
    listeners.swap(listeners_);
    calls.swap(calls_);
    deadlines_.clear();
    functions.swap(functions_);
    peers.swap(peers_);
    if (tickTimer_) Loop::instance().cancelTimer(tickTimer_);
  }
  for (auto& l : links) l->conn->close(Error("the Rpc was closed"));
  for (auto& l : listeners) l->close();
  for (auto& [id, c] : calls) {
    c.future->setError(
        Error(ErrorCode::kConnectionLost, concat("call to peer '", c.peer, "' function '",
                                                 c.function, "' failed: the Rpc was closed")));
  }
}

DebugInfo Rpc::debugInfo() {
  DebugInfo info;
  std::lock_guard<std::mutex> lock(mutex_);
  info.name = name_;
  // TCP first, as before there were more transports.
  auto tcp = listenAddresses_.find(kBootstrapTransport);
  if (tcp != listenAddresses_.end()) info.listening = tcp->second;
  for (auto& [transport, addresses] : listenAddresses_) {
    if (transport != kBootstrapTransport)
      info.listening.insert(info.listening.end(), addresses.begin(), addresses.end());
  }
  info.advertised = advertisedLocked();
  info.transports.assign(transports_.begin(), transports_.end());
  info.available = contexts_.status();
  info.pendingCalls = calls_.size();
  info.unidentifiedConnections = 0;
  for (auto& l : links_) {
    if (l->state != Link::State::kReady) ++info.unidentifiedConnections;
  }
  for (auto& [name, p] : peers_) {
    PeerInfo pi{name, p.host == hostIdentity(), p.addresses, {}, p.queued.size(), "", "", ""};
    for (auto& l : p.links) {
      pi.connections.push_back(ConnectionInfo{
          l->conn->transport(), l->conn->localAddress(), l->conn->remoteAddress(), l->outgoing,
          l->conn->bytesSent(), l->conn->bytesReceived(), l->why, l->conn->lanes()});
    }
    if (auto best = bestLinkLocked(p)) pi.transport = best->conn->transport();
    TransportChoice choice =
        contexts_.choose(peerTransportsLocked(p.host, p.domains, p.reported), transports_, forced_);
    if (choice.context) pi.chosen = choice.context->name();
    pi.why = choice.why;
    info.peers.push_back(std::move(pi));
  }
  for (auto& [name, h] : functions_) info.functions.push_back(name);
  return info;
}

}  // namespace moolib
