// The shared-memory transport: peers on the same host (same boot id and
// network namespace) reach each other through an abstract Unix socket named
// "shm://<name>" and exchange large segments through shared memory.
#include "runtime/host.h"
#include "shm/shm_region.h"
#include "transport/shm/connection_impl.h"
#include "transport/socket_listener.h"

namespace moolib {

namespace {

constexpr const char* kPrefix = "shm://";

class ShmContext : public Context {
 public:
  const char* name() const override { return "shm"; }
  // Above every network transport: one copy through memory.
  int priority() const override { return 300; }
  // Abstract Unix sockets are per network namespace, memfds per machine.
  std::string domain() const override { return hostIdentity(); }
  Reach reach(const std::string& peerDomain, bool sameHost) const override {
    if (peerDomain == hostIdentity()) return {Reach::kAuto, "same host and network namespace"};
    return {Reach::kNo, "another host or network namespace"};
  }
  bool hostLocal() const override { return true; }
  std::string companionAddress(const std::string& incarnation, const std::string& tcpAddress,
                               bool forced) const override {
    return kPrefix + incarnation + "-" + randomHex(4);
  }
  bool handles(const std::string& address) const override { return address.rfind(kPrefix, 0) == 0; }

  std::unique_ptr<Listener> listen(const std::string& address, AcceptFn onAccept) override {
    auto l = SocketListener::create(unixAbstractAddress(endpoint(address)), address,
                                    &ShmConnection::create, std::move(onAccept));
    return std::make_unique<ListenerHandle>(std::move(l));
  }

  void connect(const std::string& address, ConnectFn done) override {
    SockAddr addr;
    try {
      addr = unixAbstractAddress(endpoint(address));
    } catch (const Exception& e) {
      Error err(e.what());
      Loop::instance().addTimer(Clock::now(), [done, err] { done(err, nullptr); });
      return;
    }
    connectSocket(addr, address, &ShmConnection::create, std::move(done));
  }

 private:
  static std::string endpoint(const std::string& address) {
    MOO_ENFORCE(address.rfind(kPrefix, 0) == 0 && address.size() > 6, "bad shared-memory address '",
                address, "'");
    return address.substr(6);
  }
};

}  // namespace

std::unique_ptr<Context> createShmContext(std::string& whyNot) {
  // Viability: this kernel must let us make and map shared regions.
  try {
    ShmRegion::create("moolib-probe", 1);
  } catch (const ShmError& e) {
    whyNot = e.what();
    return nullptr;
  }
  return std::make_unique<ShmContext>();
}

}  // namespace moolib
