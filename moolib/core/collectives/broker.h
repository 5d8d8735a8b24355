// The broker: tracks groups of peers, their liveness and a sync id that
// changes whenever a group's membership does.
//
// Members ping the broker (Group does, every fraction of its timeout); a
// member that has not pinged within its timeout is dropped, and so is one
// whose links to the broker all closed and did not come back within half a
// second (its process ended: see Rpc::onPeerLost). Every ping is
// answered with the group's sync id and ordered member list, so all members
// of one sync id see the same list.
#pragma once

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "rpc/rpc.h"

namespace moolib {

// How often a member with group timeout ``timeoutSeconds`` pings its broker.
// A new group's first membership also waits this long after its first member
// arrives, or less if a member with a shorter interval comes meanwhile (the
// join window, see Broker::State::handle), so that peers started together
// form it together.
inline double pingIntervalSeconds(double timeoutSeconds) {
  return std::clamp(timeoutSeconds / 8, 0.02, 1.0);
}

// The broker's function, and its messages (segment 0 of a call and its reply).
constexpr const char* kBrokerFunction = "__moolib_broker";

struct BrokerRequest {
  enum Kind : uint8_t { kPing = 1, kLeave = 2 };
  uint8_t kind = kPing;
  std::string group;
  int64_t sortOrder = 0;
  double timeoutSeconds = 10;
  // Members with equal non-empty keys can share memory (see shm/shm_region.h).
  std::string shmKey;
  // Set by a member that lost track of the group (or never had it): the
  // group gets a new sync id even if the broker still lists the member, so
  // nobody mixes collectives from before and after.
  bool rejoin = false;
  // The sync id the member holds (0: none). A ping whose sync id is still
  // the group's is held by the broker until the membership changes or a
  // ping interval passes (a long poll), so that a change reaches every
  // member at once rather than at its next ping.
  uint64_t knownSyncId = 0;
  std::string encode() const;
  static BrokerRequest decode(std::string_view data);
};

struct BrokerReply {
  uint64_t syncId = 0;
  std::vector<std::string> members;
  std::vector<std::string> shmKeys;  // one per member
  std::string encode() const;
  static BrokerReply decode(std::string_view data);
};

class Broker {
 public:
  explicit Broker(std::shared_ptr<Rpc> rpc);
  ~Broker();
  Broker(const Broker&) = delete;
  Broker& operator=(const Broker&) = delete;

  // Drops members that missed their timeout; call regularly.
  void update();
  // Groups and their current members, for inspection.
  std::map<std::string, BrokerReply> groups();
  std::shared_ptr<Rpc> rpc() const { return rpc_; }

  struct State;

 private:
  std::shared_ptr<Rpc> rpc_;
  std::shared_ptr<State> state_;
  std::shared_ptr<void> peerLost_;  // the Rpc's onPeerLost token
};

}  // namespace moolib
