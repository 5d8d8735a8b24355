// Private state of an Rpc shared by rpc.cc and rpc_links.cc.
#pragma once

#include <list>
#include <map>

#include "rpc/rpc.h"

namespace moolib {

// One connection to another peer and where its handshake stands.
struct Rpc::Link {
  enum class State { kHello, kAuth, kIdentify, kReady };

  ConnectionPtr conn;
  bool outgoing = false;
  std::string dialAddress;  // set when made by connect(): redialed on loss
  std::string dialing;      // its entry in dialing_ (under the Rpc mutex; see adopt)
  // Written by the thread handling the connection's frames, read elsewhere
  // under the Rpc mutex; peer* fields are published by state becoming kReady.
  std::atomic<State> state{State::kHello};
  std::string myNonce, peerNonce;
  std::string peerName, peerIncarnation, peerHost;
  std::vector<std::string> peerAddresses;
  // The peer's transports (name -> domain) from its identify; reported is
  // false for a peer that sent none (then tcp, and shm on the same host).
  std::map<std::string, std::string> peerDomains;
  bool peerReported = false;
  std::string why;           // why this link was made (debug_info)
  bool authRefused = false;  // noted by noteAuthFailure (under the Rpc mutex)
  // Closed by this Rpc because nothing came within the keepalive timeout
  // (under the Rpc mutex): a silent peer, not one known to be gone.
  bool silent = false;
  TimePoint created = Clock::now();
  std::atomic<TimePoint> lastReceived{Clock::now()};
  uint64_t lastBytesSent = 0;
  TimePoint lastSendCheck = Clock::now();
  // Accepted links still in their handshake are listed (under the Rpc mutex)
  // in pendingIncoming_, so that the oldest can be shed when hostile
  // connections crowd the table; source is the remote host they came from.
  bool pendingListed = false;
  std::list<std::shared_ptr<Link>>::iterator pendingPos;
  std::string source;
};

// A peer known by name, with its ready links and the calls waiting for one.
struct Rpc::Peer {
  std::string name, incarnation, host;
  std::vector<std::string> addresses;
  std::map<std::string, std::string> domains;
  bool reported = false;
  std::vector<std::shared_ptr<Link>> links;
  std::vector<QueuedCall> queued;
  TimePoint nextDiscovery{};
  // When its last link closed: a peer with no link and no queued call is
  // forgotten a while later, so that a long-lived peer does not keep one
  // entry per peer that ever came and went.
  TimePoint idleSince = Clock::now();
};

}  // namespace moolib
