// The transport registry: which transports exist, which are viable in this
// process, and which one a link to a given peer should use. Transports are
// data here: the RPC layer asks the registry rather than testing names.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace moolib {

// The names of the transports the core itself names.
constexpr const char* kShmTransport = "shm";
// The transport of a plain "host:port": every peer has it, and links start on
// it and then upgrade.
constexpr const char* kBootstrapTransport = "tcp";

struct TransportEntry {
  // What a peer that did not list its transports (one from before the list)
  // is taken to have of this one: nothing, the transport (its domain empty),
  // or the transport reaching the peer's host (its domain the host identity).
  enum class Assumed { kNo, kYes, kItsHost };

  std::string name;
  std::vector<std::string> aliases;  // other names set_transports() accepts
  // Its addresses mean something only on this host: never told to peers on
  // another host (known here even where the transport is not viable).
  bool hostLocal;
  Assumed assumed;
  // The transport's context, or nullptr with the reason it is not viable here.
  std::unique_ptr<Context> (*create)(std::string& whyNot);
};

// Every transport, in no particular order (priorities come from the contexts).
const std::vector<TransportEntry>& transportRegistry();
// The canonical name for a name or alias; "" when unknown.
std::string canonicalTransport(const std::string& name);
// "shm, tcp, ucx": for error messages.
std::string knownTransports();
// The transport an address is for: its scheme ("ucx://..."), or the
// bootstrap transport, TCP, for a plain "host:port".
std::string transportOfAddress(const std::string& address);
// Whether a peer on another host must never be told this address: one of a
// host-local transport, or a loopback one.
bool isHostLocalAddress(const std::string& address);

struct TransportStatus {
  std::string name;
  bool available = false;
  int priority = 0;
  std::string domain;  // when available
  std::string why;     // when not
};

// The transports (name -> domain) of a peer on host peerHost that did not
// list its own: what TransportEntry::assumed says of each.
std::map<std::string, std::string> assumedDomains(const std::string& peerHost);

// What a transport choice needs to know about a peer.
struct PeerTransports {
  bool sameHost = false;
  // name -> domain, as the peer reported them in its handshake.
  std::map<std::string, std::string> domains;
};

struct TransportChoice {
  Context* context = nullptr;
  std::string why;  // the reason for the choice, and why better ones were passed over
};

// The transports of one Rpc: a context for each viable registered transport.
class TransportSet {
 public:
  TransportSet();
  // nullptr when the transport is not viable here (or unknown).
  Context* get(const std::string& name) const;
  // The bootstrap transport's context (kBootstrapTransport); nullptr when it
  // is not viable here.
  Context* bootstrap() const { return get(kBootstrapTransport); }
  // The context that handles this address; throws when its transport is not
  // viable here.
  Context* forAddress(const std::string& address) const;
  // Viable transports, highest priority first.
  const std::vector<Context*>& byPriority() const { return ordered_; }
  int priority(const std::string& name) const;
  bool hostLocal(const std::string& name) const;
  // Every registered transport, viable or not.
  const std::vector<TransportStatus>& status() const { return status_; }
  // "name=domain" for each viable transport: what the handshake tells peers.
  std::vector<std::string> domains() const;
  // The best transport for a link to this peer: the highest priority one
  // that is allowed and that it reaches (a transport that reaches only when
  // forced counts when set_transports named it: forced).
  TransportChoice choose(const PeerTransports& peer, const std::set<std::string>& allowed,
                         const std::set<std::string>& forced) const;
  // Hands the contexts over (a forked child abandons them).
  std::vector<std::shared_ptr<Context>> release();

 private:
  std::vector<std::shared_ptr<Context>> contexts_;
  std::vector<Context*> ordered_;
  std::vector<TransportStatus> status_;
};

// Parses the handshake's "name=domain" strings; malformed ones are skipped.
std::map<std::string, std::string> parseDomains(const std::vector<std::string>& items);

}  // namespace moolib
