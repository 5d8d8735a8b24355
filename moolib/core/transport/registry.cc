// The transport registry (see registry.h). A new transport adds its folder
// and one line to kEntries below.
#include "transport/registry.h"

#include <algorithm>

#include "runtime/logging.h"
#include "runtime/socket.h"

namespace moolib {

// Defined in each transport's context_impl.cc.
std::unique_ptr<Context> createShmContext(std::string& whyNot);
std::unique_ptr<Context> createTcpContext(std::string& whyNot);
std::unique_ptr<Context> createUcxContext(std::string& whyNot);

const std::vector<TransportEntry>& transportRegistry() {
  static const std::vector<TransportEntry> kEntries = {
      {kShmTransport, {"ipc"}, true, TransportEntry::Assumed::kItsHost, &createShmContext},
      {kBootstrapTransport, {}, false, TransportEntry::Assumed::kYes, &createTcpContext},
      {"ucx", {}, false, TransportEntry::Assumed::kNo, &createUcxContext},
  };
  return kEntries;
}

std::string canonicalTransport(const std::string& name) {
  for (auto& e : transportRegistry()) {
    if (e.name == name || std::find(e.aliases.begin(), e.aliases.end(), name) != e.aliases.end()) {
      return e.name;
    }
  }
  return "";
}

std::string knownTransports() {
  std::string out;
  for (auto& e : transportRegistry()) out += (out.empty() ? "" : ", ") + e.name;
  return out;
}

std::string transportOfAddress(const std::string& address) {
  auto scheme = address.find("://");
  return scheme == std::string::npos ? kBootstrapTransport : address.substr(0, scheme);
}

std::map<std::string, std::string> assumedDomains(const std::string& peerHost) {
  std::map<std::string, std::string> out;
  for (auto& e : transportRegistry()) {
    if (e.assumed == TransportEntry::Assumed::kYes) out[e.name] = "";
    if (e.assumed == TransportEntry::Assumed::kItsHost) out[e.name] = peerHost;
  }
  return out;
}

bool isHostLocalAddress(const std::string& address) {
  std::string name = transportOfAddress(address);
  for (auto& e : transportRegistry()) {
    if (e.name == name && e.hostLocal) return true;
  }
  return isLoopbackHostPort(hostPortOf(address));
}

std::string hostPortOf(const std::string& address) {
  auto scheme = address.find("://");
  return scheme == std::string::npos ? address : address.substr(scheme + 3);
}

TransportSet::TransportSet() {
  for (auto& e : transportRegistry()) {
    TransportStatus st;
    st.name = e.name;
    std::string whyNot;
    std::unique_ptr<Context> ctx;
    try {
      ctx = e.create(whyNot);
    } catch (const std::exception& ex) {
      whyNot = ex.what();
    }
    if (ctx) {
      st.available = true;
      st.priority = ctx->priority();
      st.domain = ctx->domain();
      if (st.domain.size() > 1024) st.domain.resize(1024);
      contexts_.push_back(std::move(ctx));
    } else {
      st.why = whyNot.empty() ? "not available" : whyNot;
      MOO_LOG(kVerbose, "transport ", e.name, " is not available here: ", st.why);
    }
    status_.push_back(std::move(st));
  }
  for (auto& c : contexts_) ordered_.push_back(c.get());
  std::stable_sort(ordered_.begin(), ordered_.end(),
                   [](Context* a, Context* b) { return a->priority() > b->priority(); });
}

Context* TransportSet::get(const std::string& name) const {
  for (auto* c : ordered_) {
    if (name == c->name()) return c;
  }
  return nullptr;
}

Context* TransportSet::forAddress(const std::string& address) const {
  for (auto* c : ordered_) {
    if (c->handles(address)) return c;
  }
  // A registered transport that would take it, but is not viable here.
  std::string name = transportOfAddress(address);
  for (auto& st : status_) {
    MOO_ENFORCE(st.name != name || name == kBootstrapTransport, "address '", address,
                "': transport ", name, " is not available here (", st.why, ")");
  }
  throw Exception(concat("bad address '", address, "': unknown scheme '", name,
                         "://' (give host:port for TCP, or an address of: ", knownTransports(),
                         ")"));
}

int TransportSet::priority(const std::string& name) const {
  auto* c = get(name);
  return c ? c->priority() : -1;
}

bool TransportSet::hostLocal(const std::string& name) const {
  for (auto& e : transportRegistry()) {
    if (e.name == name) return e.hostLocal;
  }
  return false;
}

std::vector<std::string> TransportSet::domains() const {
  std::vector<std::string> out;
  for (auto& st : status_) {
    if (st.available) out.push_back(st.name + "=" + st.domain);
  }
  return out;
}

TransportChoice TransportSet::choose(const PeerTransports& peer,
                                     const std::set<std::string>& allowed,
                                     const std::set<std::string>& forced) const {
  TransportChoice choice;
  std::string passed;
  auto note = [&](const std::string& s) { passed += (passed.empty() ? "" : "; ") + s; };
  for (auto* c : ordered_) {
    std::string name = c->name();
    if (!allowed.count(name)) {
      note(name + ": not in set_transports()");
      continue;
    }
    auto d = peer.domains.find(name);
    if (d == peer.domains.end()) {
      note(name + ": the peer does not have it");
      continue;
    }
    Reach r = c->reach(d->second, peer.sameHost);
    if (r.kind == Reach::kAuto || (r.kind == Reach::kForced && forced.count(name))) {
      choice.context = c;
      choice.why = name + ": " + r.why;
      break;
    }
    note(name + ": " + r.why);
  }
  if (!choice.context) choice.why = "no transport reaches the peer";
  if (!passed.empty()) choice.why += " (passed over: " + passed + ")";
  return choice;
}

std::vector<std::shared_ptr<Context>> TransportSet::release() {
  ordered_.clear();
  return std::move(contexts_);
}

std::map<std::string, std::string> parseDomains(const std::vector<std::string>& items) {
  std::map<std::string, std::string> out;
  for (auto& item : items) {
    auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0) continue;
    out.emplace(item.substr(0, eq), item.substr(eq + 1));
  }
  return out;
}

}  // namespace moolib
