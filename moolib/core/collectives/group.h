// A group of peers known to a broker, and the collectives among them.
//
// From the first update() on, the group pings the broker from a loop timer
// (not only when update() is called), so a member blocked waiting for an all-reduce still learns
// that membership changed, and the all-reduce fails instead of hanging. Each collective is bound to
// the sync id it started under; when the sync id changes, or the broker has not answered for a
// whole timeout, every collective in flight fails.
//
// Membership follows the program, not only the process: a member whose program has not called
// update() for a whole timeout (its loop hung, or it dropped the group) leaves, so the others do
// not wait on it; its next update() rejoins. A long computation that cannot call update() keeps its
// membership explicitly with holdMembership().
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/collective.h"
#include "rpc/rpc.h"
#include "shm/shm_region.h"

namespace moolib {

class Group : public std::enable_shared_from_this<Group> {
 public:
  static std::shared_ptr<Group> create(std::shared_ptr<Rpc> rpc, const std::string& name);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  // Joins on the first call; then true once after each membership change.
  bool update();
  std::vector<std::string> members() const;
  uint64_t syncId() const;
  bool active() const;
  const std::string& name() const { return name_; }
  void setTimeout(double seconds);
  double timeout() const;
  // How long a collective may take before it fails everywhere, naming the
  // members it waits for; 0 (the default) means max(60 s, 2 x the timeout).
  void setCollectiveTimeout(double seconds);
  double collectiveTimeout() const;
  void setSortOrder(int64_t order);
  void setBrokerName(const std::string& name);
  // While held (nested holds count), the member stays in the group however
  // long it goes without update(); releasing counts as an update().
  void holdMembership(bool hold);
  // Asks the broker for a new sync id (the members stay): every member sees
  // a membership change, e.g. to start a protocol over together.
  void resync();

  // Sums buffers in place across the members; the future completes with no
  // segments once every buffer holds the sum.
  // With syncId non-zero, fails at once unless membership is still that one.
  // Members whose structure digests differ fail (see CollectiveMessage).
  FuturePtr allReduce(const std::string& name, std::vector<TypedBuffer> buffers,
                      uint64_t syncId = 0, uint64_t structure = 0);
  // Every member's segments, in member order (see Collective).
  FuturePtr allGather(const std::string& name, std::vector<OutSegment> segments,
                      uint64_t syncId = 0);
  // Leaves the group (tells the broker) and fails what is in flight.
  void close();

  Group(std::shared_ptr<Rpc> rpc, const std::string& name);  // use create()

 private:
  struct Early {
    std::string from;
    CollectiveMessage message;
    std::vector<BufferPtr> data;
    TimePoint received = Clock::now();
  };

  void start();
  void tick();
  void ping();
  void onBrokerReply(const FuturePtr& reply);
  void onMessage(const std::shared_ptr<Responder>& responder, std::vector<BufferPtr> args);
  template <typename... Args>
  FuturePtr startOp(const std::string& name, uint64_t syncId, Args&&... args);
  // Forgets the membership and fails the collectives in flight.
  void leaveLocked(const std::string& why, std::vector<std::shared_ptr<Collective>>& failed);
  void sendLeave(const std::string& broker);
  void failAllLocked(const std::string& why, std::vector<std::shared_ptr<Collective>>& out);
  bool activeLocked() const;
  double pingIntervalLocked() const;
  double collectiveTimeoutLocked() const;

  const std::shared_ptr<Rpc> rpc_;
  const std::string name_;
  const std::string function_;

  mutable std::mutex mutex_;
  std::string brokerName_ = "broker";
  double timeoutSeconds_ = 10;
  double collectiveTimeoutSeconds_ = 0;
  int64_t sortOrder_ = 0;
  uint64_t syncId_ = 0;
  std::vector<std::string> members_;
  // Whether all members can share memory (equal shm keys), and this
  // process's regions and mappings for it.
  bool sameHost_ = false;
  bool shmFailed_ = false;
  std::shared_ptr<RegionCache> regions_ = std::make_shared<RegionCache>();
  bool changed_ = false;
  bool inContact_ = false;
  TimePoint lastContact_;
  bool joined_ = false;
  TimePoint lastUpdate_{};
  // Left because update() was not called for a timeout; update() rejoins.
  bool idle_ = false;
  int holds_ = 0;
  bool resync_ = false;
  bool pingInFlight_ = false;
  TimePoint lastPing_{};
  uint64_t timer_ = 0;
  bool closed_ = false;
  std::map<OpKey, std::shared_ptr<Collective>> ops_;
  std::map<std::string, uint64_t> nextSeq_;  // per collective name, under this sync id
  // Messages that came before their collective started here.
  std::map<OpKey, std::vector<Early>> early_;
  size_t earlyCount_ = 0;
  // Collectives aborted by another member before they started here, and
  // those that failed here: a late message for one is answered with why.
  std::map<OpKey, Error> aborted_;
  // The latest sync ids this member left, most recent last: a message of one
  // of them is refused rather than kept for a collective that never starts.
  std::deque<uint64_t> pastSyncIds_;
};

}  // namespace moolib
