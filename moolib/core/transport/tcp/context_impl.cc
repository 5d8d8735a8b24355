// The TCP transport: works between any two hosts that can route to each other.
#include "runtime/host.h"
#include "transport/socket_listener.h"
#include "transport/tcp/connection_impl.h"

namespace moolib {

namespace {

// Tries the addresses a name resolves to in turn, as Python's
// socket.create_connection does: on most hosts "localhost" is ::1 before
// 127.0.0.1, and a peer listening on 127.0.0.1 alone must still be reached.
void connectInTurn(std::shared_ptr<const std::vector<SockAddr>> addrs, size_t index,
                   std::string address, std::string failures, Context::ConnectFn done) {
  const SockAddr& addr = (*addrs)[index];
  std::string attempt =
      addrs->size() == 1 ? address : concat(address, " (", formatTcpAddress(addr), ")");
  connectSocket(addr, std::move(attempt), &TcpConnection::create,
                [addrs, index, address, failures, done](const Error& e, ConnectionPtr conn) {
                  std::string all = failures.empty() ? e.what() : concat(failures, "; ", e.what());
                  if (e && index + 1 < addrs->size()) {
                    connectInTurn(addrs, index + 1, address, std::move(all), done);
                  } else {
                    done(e ? Error(all) : e, std::move(conn));
                  }
                });
}

class TcpContext : public Context {
 public:
  const char* name() const override { return "tcp"; }
  int priority() const override { return 100; }
  // The interface addresses a peer may reach this host at.
  std::string domain() const override {
    std::string out;
    for (auto& a : interfaceAddresses()) out += (out.empty() ? "" : ",") + a;
    return out;
  }
  Reach reach(const std::string& peerDomain, bool sameHost) const override {
    return {Reach::kAuto, sameHost ? "loopback" : "routes between hosts"};
  }
  bool handles(const std::string& address) const override {
    return address.find("://") == std::string::npos;
  }
  void checkAddress(const std::string& address) const override { checkTcpAddress(address); }

  std::unique_ptr<Listener> listen(const std::string& address, AcceptFn onAccept) override {
    SockAddr addr = parseTcpAddress(address);
    auto l = SocketListener::create(addr, address, &TcpConnection::create, std::move(onAccept));
    return std::make_unique<ListenerHandle>(std::move(l));
  }

  void connect(const std::string& address, ConnectFn done) override {
    std::shared_ptr<const std::vector<SockAddr>> addrs;
    try {
      addrs = std::make_shared<const std::vector<SockAddr>>(resolveTcpAddress(address));
    } catch (const Exception& e) {
      Error err(e.what());
      Loop::instance().addTimer(Clock::now(), [done, err] { done(err, nullptr); });
      return;
    }
    connectInTurn(std::move(addrs), 0, address, "", std::move(done));
  }
};

}  // namespace

std::unique_ptr<Context> createTcpContext(std::string& whyNot) {
  return std::make_unique<TcpContext>();
}

}  // namespace moolib
