// The TCP transport: works between any two hosts that can route to each other.
#include "transport/socket_listener.h"
#include "transport/tcp/connection_impl.h"

namespace moolib {

namespace {

class TcpContext : public Context {
 public:
  const char* name() const override { return "tcp"; }
  bool handles(const std::string& address) const override {
    return address.find("://") == std::string::npos;
  }

  std::unique_ptr<Listener> listen(const std::string& address, AcceptFn onAccept) override {
    SockAddr addr = parseTcpAddress(address);
    auto l = SocketListener::create(addr, address, &TcpConnection::create, std::move(onAccept));
    return std::make_unique<ListenerHandle>(std::move(l));
  }

  void connect(const std::string& address, ConnectFn done) override {
    SockAddr addr;
    try {
      addr = parseTcpAddress(address);
    } catch (const Exception& e) {
      Error err(e.what());
      Loop::instance().addTimer(Clock::now(), [done, err] { done(err, nullptr); });
      return;
    }
    connectSocket(addr, address, &TcpConnection::create, std::move(done));
  }
};

}  // namespace

std::unique_ptr<Context> createTcpContext() { return std::make_unique<TcpContext>(); }

}  // namespace moolib
