#include "collectives/group.h"

#include <algorithm>
#include <utility>

#include "collectives/broker.h"
#include "rpc/wire.h"
#include "runtime/logging.h"
#include "transport/registry.h"

namespace moolib {

namespace {
constexpr const char* kGroupFunctionPrefix = "__moolib_group/";
// Messages held for collectives not started here yet (other members ahead).
constexpr size_t kMaxEarly = 1 << 16;
// How often a member pings while its new group forms (see pingIntervalLocked).
constexpr double kFormingPingSeconds = 0.02;
// Past sync ids remembered (see pastSyncIds_).
constexpr size_t kPastSyncIds = 64;

FuturePtr failedFuture(Error error) {
  auto f = std::make_shared<FutureState>();
  f->setError(std::move(error));
  return f;
}

// Failures of this member's part in the group: the others see a membership
// change, and so does this member's caller.
Error membershipChanged(std::string why) {
  return Error(ErrorCode::kMembershipChanged, std::move(why));
}

}  // namespace

std::shared_ptr<Group> Group::create(std::shared_ptr<Rpc> rpc, const std::string& name) {
  auto group = std::make_shared<Group>(std::move(rpc), name);
  group->start();
  return group;
}

Group::Group(std::shared_ptr<Rpc> rpc, const std::string& name)
    : rpc_(std::move(rpc)), name_(name), function_(kGroupFunctionPrefix + name) {
  MOO_ENFORCE(!name.empty() && name.size() <= 512, "group name must be 1 to 512 characters");
}

Group::~Group() { close(); }

void Group::start() {
  // The group is one function of its Rpc, so the name is taken there.
  MOO_ENFORCE(!rpc_->isDefined(function_), "this Rpc already has a Group named '", name_,
              "' (one Group per name on an Rpc)");
  std::weak_ptr<Group> weak = shared_from_this();
  rpc_->define(function_,
               [weak](std::shared_ptr<Responder> responder, std::vector<BufferPtr> args) {
                 auto self = weak.lock();
                 if (!self) {
                   return responder->error("the group is closed", ErrorCode::kMembershipChanged);
                 }
                 self->onMessage(responder, std::move(args));
               });
}

double Group::pingIntervalLocked() const {
  // While the broker's join window holds this member back (in contact, not
  // yet listed), ping often: the window closes at the first ping after it.
  double interval = pingIntervalSeconds(timeoutSeconds_);
  return inContact_ && members_.empty() ? std::min(interval, kFormingPingSeconds) : interval;
}

double Group::collectiveTimeoutLocked() const {
  return collectiveTimeoutSeconds_ > 0 ? collectiveTimeoutSeconds_
                                       : std::max(60.0, 2 * timeoutSeconds_);
}

void Group::tick() {
  std::vector<std::shared_ptr<Collective>> failed;
  bool doPing = false;
  bool leave = false;
  std::string why;
  std::string broker;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    auto now = Clock::now();
    auto interval = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(pingIntervalLocked()));
    auto timeout = std::chrono::duration<double>(timeoutSeconds_);
    if (!idle_ && holds_ == 0 && now - lastUpdate_ > timeout) {
      // The program stopped calling update(): leave at once rather than let
      // the others wait a timeout more for the broker to drop this member.
      idle_ = true;
      leave = inContact_;
      broker = brokerName_;
      why = concat("this peer left group '", name_, "': update() was not called for ",
                   timeoutSeconds_, " s (the group timeout); the next update() rejoins");
      MOO_LOG(kInfo, "group: ", why);
      leaveLocked(why, failed);
    } else if (inContact_ && now - lastContact_ > timeout) {
      why = concat("lost contact with the broker '", brokerName_, "' of group '", name_, "'");
      MOO_LOG(kInfo, "group: ", why);
      leaveLocked(why, failed);
    }
    if (!idle_ && !pingInFlight_ && now - lastPing_ >= interval) {
      pingInFlight_ = true;
      lastPing_ = now;
      doPing = true;
    }
    std::weak_ptr<Group> weak = shared_from_this();
    timer_ = Loop::instance().addTimer(now + interval, [weak] {
      if (auto self = weak.lock()) self->tick();
    });
  }
  for (auto& op : failed) {
    op->fail(membershipChanged(concat(op->describe(), " failed: ", why)), false);
  }
  if (leave) sendLeave(broker);
  if (doPing) ping();
}

void Group::leaveLocked(const std::string& why, std::vector<std::shared_ptr<Collective>>& failed) {
  if (inContact_) changed_ = true;
  inContact_ = false;
  failAllLocked(why, failed);
  syncId_ = 0;
  members_.clear();
}

void Group::sendLeave(const std::string& broker) {
  BrokerRequest q;
  q.kind = BrokerRequest::kLeave;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    q.group = name_;
  }
  try {
    rpc_->call(broker, kBrokerFunction, {ownedSegment(q.encode())});
  } catch (const std::exception& e) {
    MOO_LOG(kVerbose, "group '", name_, "': cannot tell the broker this peer left: ", e.what());
  }
}

void Group::ping() {
  BrokerRequest q;
  std::string broker;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    q.group = name_;
    q.sortOrder = sortOrder_;
    q.timeoutSeconds = timeoutSeconds_;
    if (!shmFailed_ && rpc_->transportAllowed(kShmTransport)) q.shmKey = localShmKey();
    q.rejoin = !inContact_ || std::exchange(resync_, false);
    // The broker holds this ping while the membership stays as it is (up to
    // a ping interval), so its answer comes as soon as it changes.
    if (!q.rejoin && !members_.empty()) q.knownSyncId = syncId_;
    broker = brokerName_;
  }
  FuturePtr reply;
  try {
    // The broker may hold it for an interval: that is no part of its timeout.
    double timeout = rpc_->timeout() + pingIntervalSeconds(q.timeoutSeconds);
    reply = rpc_->call(broker, kBrokerFunction, {ownedSegment(q.encode())}, false, timeout);
  } catch (const std::exception& e) {
    MOO_LOG(kVerbose, "group '", name_, "': cannot ping the broker: ", e.what());
    std::lock_guard<std::mutex> lock(mutex_);
    pingInFlight_ = false;
    return;
  }
  std::weak_ptr<Group> weak = shared_from_this();
  reply->onDone([weak, reply] {
    if (auto self = weak.lock()) self->onBrokerReply(reply);
  });
}

void Group::onBrokerReply(const FuturePtr& reply) {
  std::vector<std::shared_ptr<Collective>> failed;
  std::string why;
  bool pingAgain = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pingInFlight_ = false;
    // A reply to a ping sent before this peer left for being idle.
    if (closed_ || idle_) return;
    if (reply->error()) {
      MOO_LOG(kVerbose, "group '", name_, "': broker ping failed: ", reply->error().what());
      return;
    }
    BrokerReply r;
    try {
      MOO_ENFORCE(!reply->result().empty(), "empty reply");
      auto& seg = reply->result()[0];
      r = BrokerReply::decode({reinterpret_cast<const char*>(seg->data()), seg->size()});
    } catch (const std::exception& e) {
      MOO_LOG(kError, "group '", name_, "': malformed broker reply: ", e.what());
      return;
    }
    auto now = Clock::now();
    lastContact_ = now;
    if (!inContact_) changed_ = true;
    inContact_ = true;
    bool same = r.syncId == syncId_ && r.members == members_;
    if (!same) {
      why = concat("the membership of group '", name_, "' changed");
      failAllLocked(why, failed);
      regions_->forgetMapped();
      syncId_ = r.syncId;
      members_ = std::move(r.members);
      sameHost_ = members_.size() > 1 && !r.shmKeys[0].empty() &&
                  std::all_of(r.shmKeys.begin(), r.shmKeys.end(),
                              [&](auto& k) { return k == r.shmKeys[0]; });
      changed_ = true;
      MOO_LOG(kVerbose, "group '", name_, "': sync id ", syncId_, ", ", members_.size(),
              " members");
    }
    // The next ping goes at once when the broker held this one its whole
    // interval (so that one is always waiting there), or when the membership
    // changed (more changes may follow); otherwise at the next tick.
    auto interval = std::chrono::duration<double>(pingIntervalLocked());
    if (!same || now - lastPing_ >= interval) {
      pingAgain = true;
      pingInFlight_ = true;
      lastPing_ = now;
    }
  }
  for (auto& op : failed) {
    op->fail(membershipChanged(concat(op->describe(), " failed: ", why)), false);
  }
  if (pingAgain) ping();
}

void Group::failAllLocked(const std::string& why, std::vector<std::shared_ptr<Collective>>& out) {
  for (auto& [key, op] : ops_) out.push_back(op);
  ops_.clear();
  nextSeq_.clear();
  aborted_.clear();
  if (syncId_ != 0) {
    pastSyncIds_.push_back(syncId_);
    if (pastSyncIds_.size() > kPastSyncIds) pastSyncIds_.pop_front();
  }
  // Early messages of the sync id to come may already be here; keep only
  // those of no sync id left behind. Those of one this member never reached
  // (memberships that changed faster than it pinged) go once older than a
  // collective may run: their senders have failed them by then.
  auto now = Clock::now();
  auto stale = std::chrono::duration<double>(collectiveTimeoutLocked());
  for (auto it = early_.begin(); it != early_.end();) {
    bool past =
        std::find(pastSyncIds_.begin(), pastSyncIds_.end(), it->first.syncId) != pastSyncIds_.end();
    if (past || now - it->second.front().received > stale) {
      earlyCount_ -= it->second.size();
      it = early_.erase(it);
    } else {
      ++it;
    }
  }
  (void)why;
}

void Group::onMessage(const std::shared_ptr<Responder>& responder, std::vector<BufferPtr> args) {
  // Refusals of the group's own protocol are plain failures, not exceptions
  // of a function.
  if (args.empty()) return responder->error("empty group message", ErrorCode::kFailed);
  CollectiveMessage m;
  try {
    m = CollectiveMessage::decode(
        {reinterpret_cast<const char*>(args[0]->data()), args[0]->size()});
  } catch (const WireError& e) {
    MOO_LOG(kError, "group '", name_, "': malformed message from '", responder->peer(),
            "': ", e.what());
    return responder->error(concat("malformed group message: ", e.what()), ErrorCode::kFailed);
  }
  args.erase(args.begin());
  std::shared_ptr<Collective> op;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) {
      return responder->error(concat("group '", name_, "' is closed"),
                              ErrorCode::kMembershipChanged);
    }
    auto it = ops_.find(m.key);
    if (it != ops_.end()) {
      op = it->second;
    } else if (auto a = aborted_.find(m.key); a != aborted_.end()) {
      return responder->error(concat("all_reduce '", m.key.name, "' failed on '", rpc_->name(),
                                     "': ", a->second.what()),
                              a->second.code());
    } else if (std::find(pastSyncIds_.begin(), pastSyncIds_.end(), m.key.syncId) !=
               pastSyncIds_.end()) {
      return responder->error(concat("all_reduce '", m.key.name, "': the membership of group '",
                                     name_, "' changed on '", rpc_->name(), "'"),
                              ErrorCode::kMembershipChanged);
    } else if (m.kind == CollectiveMessage::kAbort) {
      if (aborted_.size() < kMaxEarly) aborted_[m.key] = Error(m.code, m.error);
    } else if (m.key.syncId == syncId_ && m.key.seq < nextSeq_[m.key.name]) {
      return responder->error(
          concat("all_reduce '", m.key.name, "' is already over on '", rpc_->name(), "'"),
          ErrorCode::kFailed);
    } else if (earlyCount_ >= kMaxEarly) {
      return responder->error(
          concat("too many messages for collectives not started on '", rpc_->name(), "'"),
          ErrorCode::kFailed);
    } else {
      early_[m.key].push_back({responder->peer(), std::move(m), std::move(args)});
      ++earlyCount_;
    }
  }
  if (op) op->onMessage(responder->peer(), m, std::move(args));
  responder->reply({});
}

template <typename... Args>
FuturePtr Group::startOp(const std::string& name, uint64_t syncId, Args&&... args) {
  MOO_ENFORCE(!name.empty() && name.size() <= 1024, "all_reduce name must be 1 to 1024 characters");
  std::shared_ptr<Collective> op;
  std::vector<Early> early;
  Error abortedBy;
  double deadline;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    deadline = collectiveTimeoutLocked();
    if (closed_) {
      return failedFuture(
          membershipChanged(concat("all_reduce '", name, "': group '", name_, "' is closed")));
    }
    auto self = std::find(members_.begin(), members_.end(), rpc_->name());
    if (!inContact_ || self == members_.end()) {
      return failedFuture(membershipChanged(
          concat("all_reduce '", name, "': this peer is not an active member of group '", name_,
                 "' (call update() until active())")));
    }
    if (syncId && syncId != syncId_) {
      return failedFuture(membershipChanged(
          concat("all_reduce '", name, "': the membership of group '", name_, "' changed")));
    }
    OpKey key{syncId_, name, nextSeq_[name]++};
    // A member's part may take as long as the collective may (a big group on
    // few cores is slow), not only as long as the Rpc's calls.
    auto send = [rpc = rpc_, function = function_, deadline](
                    const std::string& peer, std::string meta, std::vector<OutSegment> data,
                    std::function<void(const Error&)> onAck) {
      std::vector<OutSegment> segs;
      segs.reserve(1 + data.size());
      segs.push_back(ownedSegment(std::move(meta)));
      for (auto& d : data) segs.push_back(std::move(d));
      FuturePtr f;
      try {
        f = rpc->call(peer, function, std::move(segs), false, deadline);
      } catch (const std::exception& e) {
        return onAck(Error(ErrorCode::kFailed, e.what()));
      }
      f->onDone([f, onAck] { onAck(f->error()); });
    };
    op = std::make_shared<Collective>(key, members_, size_t(self - members_.begin()),
                                      std::forward<Args>(args)..., std::move(send));
    ops_[key] = op;
    if (auto it = early_.find(key); it != early_.end()) {
      early = std::move(it->second);
      earlyCount_ -= early.size();
      early_.erase(it);
    }
    if (auto it = aborted_.find(key); it != aborted_.end()) abortedBy = it->second;
  }
  std::weak_ptr<Group> weak = shared_from_this();
  std::weak_ptr<Collective> weakOp = op;
  op->setOnRetired([weak, weakOp] {
    auto self = weak.lock();
    auto done = weakOp.lock();
    if (!self || !done) return;
    std::lock_guard<std::mutex> lock(self->mutex_);
    auto it = self->ops_.find(done->key());
    if (it == self->ops_.end() || it->second != done) return;
    self->ops_.erase(it);
    // A member still in it gets this error for its late messages, not a
    // protocol error (see onMessage).
    if (auto& error = done->future()->error(); error && self->aborted_.size() < kMaxEarly) {
      self->aborted_[done->key()] = error;
    }
  });
  if (abortedBy) {
    op->fail(Error(abortedBy.code(),
                   concat(op->describe(), " failed on another member: ", abortedBy.what())),
             false);
    return op->future();
  }
  op->start();
  op->setDeadline(deadline);
  for (auto& e : early) op->onMessage(e.from, e.message, std::move(e.data));
  return op->future();
}

FuturePtr Group::allReduce(const std::string& name, std::vector<TypedBuffer> buffers,
                           uint64_t syncId, uint64_t structure) {
  std::shared_ptr<RegionCache> regions;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (sameHost_) regions = regions_;
  }
  auto future = startOp(name, syncId, std::move(buffers), std::move(regions), structure);
  // A member that cannot map its peers' memory (other user, sandbox) stops
  // offering it: the next membership goes through sockets. So does every
  // member told of it by that one's abort (the same code).
  std::weak_ptr<Group> weak = shared_from_this();
  future->onDone([weak, future] {
    auto self = weak.lock();
    if (self && future->error().code() == ErrorCode::kSharedMemoryUnavailable) {
      std::lock_guard<std::mutex> lock(self->mutex_);
      self->shmFailed_ = true;
    }
  });
  return future;
}

FuturePtr Group::allGather(const std::string& name, std::vector<OutSegment> segments,
                           uint64_t syncId) {
  return startOp(name, syncId, std::move(segments));
}

bool Group::update() {
  bool first;
  bool changed;
  bool rejoin = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    first = !joined_;
    joined_ = true;
    lastUpdate_ = Clock::now();
    if (idle_ && !closed_) {
      idle_ = false;
      MOO_LOG(kInfo, "group '", name_, "': update() called again: rejoining");
      if (!pingInFlight_) {
        pingInFlight_ = true;
        lastPing_ = lastUpdate_;
        rejoin = true;
      }
    }
    changed = changed_;
    changed_ = false;
  }
  // Joining waits for the first update(), so that settings made right after
  // construction (sort order, timeout, broker name) apply from the start.
  if (first) tick();
  if (rejoin) ping();
  return changed;
}

void Group::resync() {
  std::lock_guard<std::mutex> lock(mutex_);
  resync_ = true;
}

void Group::holdMembership(bool hold) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (hold) {
    ++holds_;
  } else {
    MOO_ENFORCE(holds_ > 0, "group '", name_, "': membership released more often than held");
    --holds_;
    lastUpdate_ = Clock::now();
  }
}

std::vector<std::string> Group::members() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return inContact_ ? members_ : std::vector<std::string>{};
}

uint64_t Group::syncId() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return syncId_;
}

bool Group::activeLocked() const {
  return inContact_ && std::find(members_.begin(), members_.end(), rpc_->name()) != members_.end();
}

bool Group::active() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return activeLocked();
}

void Group::setTimeout(double seconds) {
  MOO_ENFORCE(seconds > 0 && seconds < 1e7, "group timeout must be positive, got ", seconds);
  std::lock_guard<std::mutex> lock(mutex_);
  timeoutSeconds_ = seconds;
}

double Group::timeout() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return timeoutSeconds_;
}

void Group::setCollectiveTimeout(double seconds) {
  MOO_ENFORCE(seconds >= 0 && seconds < 1e7, "collective timeout must be >= 0, got ", seconds);
  std::lock_guard<std::mutex> lock(mutex_);
  collectiveTimeoutSeconds_ = seconds;
}

double Group::collectiveTimeout() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return collectiveTimeoutLocked();
}

void Group::setSortOrder(int64_t order) {
  std::lock_guard<std::mutex> lock(mutex_);
  sortOrder_ = order;
}

void Group::setBrokerName(const std::string& name) {
  MOO_ENFORCE(!name.empty(), "broker name must not be empty");
  std::lock_guard<std::mutex> lock(mutex_);
  brokerName_ = name;
}

void Group::close() {
  std::vector<std::shared_ptr<Collective>> failed;
  std::string broker;
  bool member;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    closed_ = true;
    if (timer_) Loop::instance().cancelTimer(timer_);
    failAllLocked("closed", failed);
    broker = brokerName_;
    member = inContact_;
    inContact_ = false;
    members_.clear();
    syncId_ = 0;
  }
  for (auto& op : failed) {
    op->fail(membershipChanged(concat(op->describe(), " failed: group '", name_, "' was closed")),
             false);
  }
  if (member) sendLeave(broker);
  try {
    rpc_->undefine(function_);
  } catch (const std::exception&) {
    // The Rpc was closed first: it has forgotten the function and the broker.
  }
}

}  // namespace moolib
