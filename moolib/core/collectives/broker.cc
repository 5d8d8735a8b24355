#include "collectives/broker.h"

#include <algorithm>
#include <optional>

#include "rpc/wire.h"
#include "runtime/host.h"
#include "runtime/logging.h"
#include "runtime/loop.h"

namespace moolib {

namespace {
constexpr size_t kMaxMembers = 1 << 16;
// How long a member whose links all closed has to link again before it
// counts as gone: its connect() redials within ~100 ms, so a link that only
// dropped is back well before; a process that ended never is.
constexpr auto kLinkLossGrace = std::chrono::milliseconds(500);
}  // namespace

std::string BrokerRequest::encode() const {
  Writer w;
  w.u8(kind);
  w.str(group);
  w.u64(uint64_t(sortOrder));
  w.f64(timeoutSeconds);
  w.str(shmKey);
  w.u8(rejoin ? 1 : 0);
  w.u64(knownSyncId);
  return w.take();
}

BrokerRequest BrokerRequest::decode(std::string_view data) {
  Reader r(data);
  BrokerRequest q;
  q.kind = r.u8();
  q.group = r.str(1024);
  q.sortOrder = int64_t(r.u64());
  q.timeoutSeconds = r.f64();
  q.shmKey = r.str(1024);
  q.rejoin = r.u8() != 0;
  // Absent from an older member's ping: never held.
  q.knownSyncId = r.remaining() >= sizeof(uint64_t) ? r.u64() : 0;
  if (q.kind != kPing && q.kind != kLeave)
    throw WireError(concat("unknown broker request kind ", int(q.kind)));
  if (q.group.empty()) throw WireError("broker request names no group");
  if (!(q.timeoutSeconds > 0 && q.timeoutSeconds < 1e7)) {
    throw WireError(concat("broker request has an invalid timeout ", q.timeoutSeconds));
  }
  return q;
}

std::string BrokerReply::encode() const {
  Writer w;
  w.u64(syncId);
  w.strings(members);
  w.strings(shmKeys);
  return w.take();
}

BrokerReply BrokerReply::decode(std::string_view data) {
  Reader r(data);
  BrokerReply b;
  b.syncId = r.u64();
  b.members = r.strings(kMaxMembers);
  b.shmKeys = r.strings(kMaxMembers);
  if (b.shmKeys.size() != b.members.size())
    throw WireError("broker reply: one shm key per member expected");
  return b;
}

struct Broker::State {
  struct Member {
    std::string name;
    int64_t sortOrder;
    uint64_t joinSeq;
    TimePoint lastSeen;
    double timeoutSeconds;
    std::string shmKey;
    // Since when it has had no link to the broker (see kLinkLossGrace).
    bool unlinked = false;
    TimePoint unlinkedSince{};
  };
  struct Group {
    std::vector<Member> members;  // kept ordered by (sortOrder, joinSeq)
    uint64_t syncId = 0;          // 0 while the group forms
    // The end of a new group's join window: until then its members are
    // told of no membership, so that peers started together meet in the
    // first one rather than one training alone before the others are listed.
    TimePoint formedAt;
  };

  // Answers to send once the lock is released: encoded replies, one shared by
  // all of a group's held pings (the list of N names is encoded once per
  // change, not once per member).
  using Encoded = std::shared_ptr<const std::string>;
  using Answers = std::vector<std::pair<std::shared_ptr<Responder>, Encoded>>;

  static Encoded encode(const BrokerReply& reply) {
    return std::make_shared<const std::string>(reply.encode());
  }

  explicit State(std::weak_ptr<Rpc> rpc) : rpc(std::move(rpc)) {}

  const std::weak_ptr<Rpc> rpc;
  std::mutex mutex;
  std::map<std::string, Group> groups;
  // Pings held until their group's membership changes (see
  // BrokerRequest::knownSyncId) or their timer answers them: by group, by id.
  std::map<std::string, std::map<uint64_t, std::shared_ptr<Responder>>> held;
  uint64_t nextJoinSeq = 0;
  uint64_t nextHoldId = 0;

  static void send(Answers answers) {
    for (auto& [responder, encoded] : answers) {
      responder->reply({OutSegment{reinterpret_cast<const uint8_t*>(encoded->data()),
                                   encoded->size(), encoded}});
    }
  }

  static BrokerReply current(const Group& g) {
    BrokerReply reply;
    reply.syncId = g.syncId;
    for (auto& m : g.members) {
      reply.members.push_back(m.name);
      reply.shmKeys.push_back(m.shmKey);
    }
    return reply;
  }

  // The group's membership now, encoded (none if the group is gone).
  Encoded encodedNow(const std::string& name) const {
    auto g = groups.find(name);
    return encode(g == groups.end() ? BrokerReply{} : current(g->second));
  }

  // Answers the group's held pings with its membership now.
  void wake(const std::string& name, Answers& out) {
    auto it = held.find(name);
    if (it == held.end()) return;
    auto reply = encodedNow(name);
    for (auto& [id, responder] : it->second) out.emplace_back(std::move(responder), reply);
    held.erase(it);
  }

  // A held ping's interval is over: it is answered with the same membership.
  void release(const std::string& name, uint64_t id) {
    Answers answers;
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto it = held.find(name);
      if (it == held.end()) return;
      auto h = it->second.find(id);
      if (h == it->second.end()) return;  // woken by a change meanwhile
      answers.emplace_back(std::move(h->second), encodedNow(name));
      it->second.erase(h);
      if (it->second.empty()) held.erase(it);
    }
    send(std::move(answers));
  }

  void closeHeld() {
    decltype(held) all;
    {
      std::lock_guard<std::mutex> lock(mutex);
      all.swap(held);
    }
    for (auto& [name, pings] : all) {
      for (auto& [id, responder] : pings) {
        responder->error("the broker is closed", ErrorCode::kFailed);
      }
    }
  }

  static void order(Group& g) {
    std::stable_sort(g.members.begin(), g.members.end(), [](const Member& a, const Member& b) {
      return a.sortOrder != b.sortOrder ? a.sortOrder < b.sortOrder : a.joinSeq < b.joinSeq;
    });
  }

  // Drops members past their timeout, and those whose links closed more than
  // kLinkLossGrace ago and are still down; returns whether any was.
  bool expire(const std::string& name, Group& g, TimePoint now) {
    auto self = rpc.lock();
    auto gone = [&](Member& m) {
      if (now - m.lastSeen > std::chrono::duration<double>(m.timeoutSeconds)) {
        MOO_LOG(kInfo, "broker: '", m.name, "' timed out of group '", name, "'");
        return true;
      }
      if (!m.unlinked || now - m.unlinkedSince < kLinkLossGrace) return false;
      if (self && self->linkedTo(m.name)) {
        m.unlinked = false;
        return false;
      }
      MOO_LOG(kInfo, "broker: '", m.name, "' left group '", name,
              "': its connections closed and it did not reconnect");
      return true;
    };
    auto end = std::remove_if(g.members.begin(), g.members.end(), gone);
    bool changed = end != g.members.end();
    g.members.erase(end, g.members.end());
    return changed;
  }

  // Marks the peer's memberships unlinked and checks them again once the
  // grace is over (from a timer, so that no update() call is needed).
  void onPeerLost(const std::string& peer, const std::shared_ptr<State>& self) {
    auto now = Clock::now();
    {
      std::lock_guard<std::mutex> lock(mutex);
      bool member = false;
      for (auto& [name, g] : groups) {
        for (auto& m : g.members) {
          if (m.name != peer) continue;
          m.unlinked = true;
          m.unlinkedSince = now;
          member = true;
        }
      }
      if (!member) return;
    }
    std::weak_ptr<State> weak = self;
    Loop::instance().addTimer(now + kLinkLossGrace + std::chrono::milliseconds(10), [weak] {
      if (auto state = weak.lock()) state->expireAll();
    });
  }

  void expireAll() {
    Answers answers;
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto now = Clock::now();
      for (auto it = groups.begin(); it != groups.end();) {
        std::string name = it->first;
        Group& g = it->second;
        bool changed = expire(name, g, now);
        if (changed && g.syncId != 0) g.syncId = randomU64();
        it = g.members.empty() ? groups.erase(it) : std::next(it);
        if (changed) wake(name, answers);
      }
    }
    send(std::move(answers));
  }

  // Answers the ping now, or holds it (see BrokerRequest::knownSyncId).
  void handle(const std::shared_ptr<State>& self, std::shared_ptr<Responder> responder,
              const BrokerRequest& q) {
    Answers answers;
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto reply = handleLocked(responder->peer(), q, answers);
      if (reply) {
        answers.emplace_back(std::move(responder), encode(*reply));
      } else {
        uint64_t id = ++nextHoldId;
        held[q.group].emplace(id, std::move(responder));
        std::weak_ptr<State> weak = self;
        auto hold = std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(pingIntervalSeconds(q.timeoutSeconds)));
        Loop::instance().addTimer(Clock::now() + hold, [weak, group = q.group, id] {
          if (auto state = weak.lock()) state->release(group, id);
        });
      }
    }
    send(std::move(answers));
  }

  // The reply to the ping, or none to hold it; the group's held pings go to
  // answers when its membership changed.
  std::optional<BrokerReply> handleLocked(const std::string& peer, const BrokerRequest& q,
                                          Answers& answers) {
    auto now = Clock::now();
    Group& g = groups[q.group];
    bool changed = expire(q.group, g, now);
    auto it = std::find_if(g.members.begin(), g.members.end(),
                           [&](const Member& m) { return m.name == peer; });
    if (q.kind == BrokerRequest::kLeave) {
      if (it != g.members.end()) {
        MOO_LOG(kInfo, "broker: '", peer, "' left group '", q.group, "'");
        g.members.erase(it);
        changed = true;
      }
    } else if (it == g.members.end()) {
      MOO_ENFORCE(g.members.size() < kMaxMembers, "group '", q.group, "' is full");
      MOO_LOG(kInfo, "broker: '", peer, "' joined group '", q.group, "'");
      if (g.syncId == 0) {
        // The window is the shortest ping interval of the members forming the
        // group: one with a short timeout (which leaves when its program does
        // not call update() for that long) is not kept waiting for a longer one.
        auto end = now + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double>(pingIntervalSeconds(q.timeoutSeconds)));
        if (g.members.empty() || end < g.formedAt) g.formedAt = end;
      }
      g.members.push_back({peer, q.sortOrder, nextJoinSeq++, now, q.timeoutSeconds, q.shmKey});
      changed = true;
    } else {
      it->lastSeen = now;
      it->unlinked = false;  // its ping came over a link
      it->timeoutSeconds = q.timeoutSeconds;
      if (it->sortOrder != q.sortOrder || it->shmKey != q.shmKey || q.rejoin) {
        it->sortOrder = q.sortOrder;
        it->shmKey = q.shmKey;
        changed = true;
      }
    }
    if (g.members.empty()) {
      groups.erase(q.group);
      wake(q.group, answers);
      return BrokerReply{};
    }
    if (g.syncId == 0 && now < g.formedAt) return BrokerReply{};  // forming: no membership yet
    if (changed || g.syncId == 0) {
      order(g);
      g.syncId = randomU64();
      wake(q.group, answers);
    } else if (q.kind == BrokerRequest::kPing && q.knownSyncId == g.syncId) {
      return std::nullopt;
    }
    return current(g);
  }
};

Broker::Broker(std::shared_ptr<Rpc> rpc)
    : rpc_(std::move(rpc)), state_(std::make_shared<State>(rpc_)) {
  std::weak_ptr<State> weak = state_;
  // A member whose process ended closes its links at once: it leaves then,
  // not a whole group timeout later.
  peerLost_ = rpc_->onPeerLost([weak](const std::string& peer) {
    if (auto state = weak.lock()) state->onPeerLost(peer, state);
  });
  rpc_->define(kBrokerFunction, [weak](std::shared_ptr<Responder> responder,
                                       std::vector<BufferPtr> args) {
    auto state = weak.lock();
    // Refusals of the broker's protocol: plain failures, not a function's exception.
    if (!state) return responder->error("the broker is closed", ErrorCode::kFailed);
    if (args.empty()) return responder->error("empty broker request", ErrorCode::kFailed);
    BrokerRequest q;
    try {
      q = BrokerRequest::decode({reinterpret_cast<const char*>(args[0]->data()), args[0]->size()});
    } catch (const WireError& e) {
      MOO_LOG(kError, "broker: malformed request from '", responder->peer(), "': ", e.what());
      return responder->error(concat("malformed broker request: ", e.what()), ErrorCode::kFailed);
    }
    state->handle(state, std::move(responder), q);
  });
}

Broker::~Broker() {
  try {
    rpc_->undefine(kBrokerFunction);
  } catch (const std::exception&) {
    // The Rpc was closed first: nothing left to undefine.
  }
  state_->closeHeld();
}

void Broker::update() { state_->expireAll(); }

std::map<std::string, BrokerReply> Broker::groups() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  std::map<std::string, BrokerReply> out;
  for (auto& [name, g] : state_->groups) {
    if (g.syncId == 0) continue;  // forming: no membership yet
    out[name] = State::current(g);
  }
  return out;
}

}  // namespace moolib
