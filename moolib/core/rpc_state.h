// Private state of an Rpc shared by rpc.cc and rpc_links.cc.
#pragma once

#include "rpc.h"

namespace moolib {

// One connection to another peer and where its handshake stands.
struct Rpc::Link {
  enum class State { kHello, kAuth, kIdentify, kReady };

  ConnectionPtr conn;
  bool outgoing = false;
  std::string dialAddress;  // set when made by connect(): redialed on loss
  // Written by the thread handling the connection's frames, read elsewhere
  // under the Rpc mutex; peer* fields are published by state becoming kReady.
  std::atomic<State> state{State::kHello};
  std::string myNonce, peerNonce;
  std::string peerName, peerIncarnation, peerHost;
  std::vector<std::string> peerAddresses;
  TimePoint created = Clock::now();
  std::atomic<TimePoint> lastReceived{Clock::now()};
  uint64_t lastBytesSent = 0;
  TimePoint lastSendCheck = Clock::now();
};

// A peer known by name, with its ready links and the calls waiting for one.
struct Rpc::Peer {
  std::string name, incarnation, host;
  std::vector<std::string> addresses;
  std::vector<std::shared_ptr<Link>> links;
  std::vector<QueuedCall> queued;
  TimePoint nextDiscovery{};
};

}  // namespace moolib
