// The UCX transport: InfiniBand, RoCE and other RDMA fabrics (and UCX's own
// shared memory and TCP) through UCP, loaded at run time. Addresses are
// "ucx://host:port": a UCP listener on that socket address; UCX's connection
// manager sets up the endpoint over the transports UCX_TLS allows.
//
// Chosen by itself only between hosts where both have an RDMA device (then
// it beats TCP); elsewhere only where set_transports() names it.
#include <netinet/in.h>

#include <condition_variable>
#include <cstring>

#include "runtime/host.h"
#include "runtime/logging.h"
#include "transport/transport.h"
#include "transport/ucx/connection_impl.h"
#include "transport/ucx/probe.h"

namespace moolib {

#if MOOLIB_UCX_HEADERS

namespace {

constexpr const char* kPrefix = "ucx://";
constexpr auto kConnectTimeout = std::chrono::seconds(10);

void connRequestCallback(ucp_conn_request_h request, void* user) {
  static_cast<UcxListener*>(user)->onConnRequest(request);
}

void epErrorCallback(void* user, ucp_ep_h ep, ucs_status_t status) {
  auto* conn = static_cast<UcxConnection*>(user);
  conn->failLocked(concat("the UCX endpoint failed: ", conn->statusText(status)));
}

std::string hostOf(const std::string& hostPort) {
  auto colon = hostPort.rfind(':');
  return colon == std::string::npos ? hostPort : hostPort.substr(0, colon);
}

class UcxContext : public Context {
 public:
  explicit UcxContext(const UcxProbe& probe) : probe_(probe) {}
  const char* name() const override { return "ucx"; }
  // Below shared memory on one host, above TCP between hosts.
  int priority() const override { return 200; }
  std::string domain() const override { return probe_.domain; }
  Reach reach(const std::string& peerDomain, bool sameHost) const override {
    if (peerDomain.empty()) return {Reach::kNo, "the peer has no UCX"};
    bool peerRdma = peerDomain.rfind("rdma=1", 0) == 0;
    if (probe_.rdma && peerRdma && !sameHost) {
      return {Reach::kAuto, "both hosts have an RDMA device"};
    }
    if (sameHost) return {Reach::kForced, "same host: only when set_transports() names ucx"};
    return {Reach::kForced,
            concat("no RDMA device on ", probe_.rdma ? "the peer's host" : "this host",
                   ": only when set_transports() names ucx")};
  }
  bool handles(const std::string& address) const override { return address.rfind(kPrefix, 0) == 0; }
  std::string companionAddress(const std::string& incarnation, const std::string& tcpAddress,
                               bool forced) const override {
    // Beside a TCP listener, on its interface, where UCX may be chosen.
    if (tcpAddress.empty() || !(forced || probe_.rdma)) return "";
    return kPrefix + hostOf(tcpAddress) + ":0";
  }

  std::unique_ptr<Listener> listen(const std::string& address, AcceptFn onAccept) override {
    std::string hostPort = endpoint(address);
    SockAddr addr = parseTcpAddress(hostPort);
    auto rt = runtime();
    MOO_ENFORCE(rt, "cannot start UCX: ", whyNot_);
    auto l = std::make_shared<UcxListener>(rt, std::move(onAccept));
    l->bind(addr, hostOf(hostPort));
    return std::make_unique<Handle>(std::move(l));
  }

  void connect(const std::string& address, ConnectFn done) override {
    SockAddr addr;
    auto rt_ = runtime();
    try {
      MOO_ENFORCE(rt_, "cannot start UCX: ", whyNot_);
      std::vector<SockAddr> addrs = resolveTcpAddress(endpoint(address));
      MOO_ENFORCE(!addrs.empty(), "'", address, "' resolves to no address");
      addr = addrs.front();
    } catch (const Exception& e) {
      Error err(e.what());
      Loop::instance().addTimer(Clock::now(), [done, err] { done(err, nullptr); });
      return;
    }
    auto conn = std::make_shared<UcxConnection>(rt_, "ucx", address);
    {
      std::lock_guard<std::mutex> lock(rt_->mutex);
      ucp_ep_params_t p{};
      p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                     UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
      p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
      p.sockaddr.addr = addr.get();
      p.sockaddr.addrlen = addr.length;
      p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      p.err_handler.cb = &epErrorCallback;
      p.err_handler.arg = conn.get();
      ucp_ep_h ep = nullptr;
      ucs_status_t st = rt_->api.ucp_ep_create(rt_->worker, &p, &ep);
      if (st != UCS_OK) {
        Error err(concat("cannot connect to ", address, ": ", rt_->api.ucs_status_string(st)));
        rt_->deferred.push_back([done, err] { done(err, nullptr); });
      } else {
        conn->dialLocked(ep, std::move(done));
        std::weak_ptr<UcxConnection> weak = conn;
        auto rt = rt_;
        conn->setConnectTimer(Loop::instance().addTimer(Clock::now() + kConnectTimeout, [weak, rt] {
          auto c = weak.lock();
          if (!c) return;
          {
            std::lock_guard<std::mutex> l(rt->mutex);
            c->failLocked("no answer within the connect timeout");
          }
          rt->runDeferred();
        }));
      }
    }
    rt_->runDeferred();
  }

 private:
  class Handle : public Listener {
   public:
    explicit Handle(std::shared_ptr<UcxListener> l) : l_(std::move(l)) {}
    ~Handle() override { l_->close(); }
    std::string address() const override { return l_->address(); }
    void close() override { l_->close(); }

   private:
    std::shared_ptr<UcxListener> l_;
  };

  static std::string endpoint(const std::string& address) {
    MOO_ENFORCE(address.rfind(kPrefix, 0) == 0 && address.size() > 6, "bad UCX address '", address,
                "' (ucx://host:port)");
    return address.substr(6);
  }

  // The runtime, started on first use.
  std::shared_ptr<UcxRuntime> runtime() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!rt_) rt_ = UcxRuntime::get(whyNot_);
    return rt_;
  }

  const UcxProbe& probe_;
  std::mutex mutex_;
  std::shared_ptr<UcxRuntime> rt_;
  std::string whyNot_;
};

}  // namespace

std::string UcxConnection::statusText(ucs_status_t s) const { return statusString(s); }

void UcxListener::bind(const SockAddr& addr, const std::string& host) {
  {
    std::lock_guard<std::mutex> lock(rt_->mutex);
    ucp_listener_params_t p{};
    p.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    p.sockaddr.addr = addr.get();
    p.sockaddr.addrlen = addr.length;
    p.conn_handler.cb = &connRequestCallback;
    p.conn_handler.arg = this;
    ucs_status_t st = rt_->api.ucp_listener_create(rt_->worker, &p, &listener_);
    MOO_ENFORCE(st == UCS_OK, "cannot listen on ucx://", formatTcpAddress(addr), ": ",
                rt_->api.ucs_status_string(st));
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    SockAddr bound;
    if (rt_->api.ucp_listener_query(listener_, &attr) == UCS_OK) {
      std::memcpy(&bound.storage, &attr.sockaddr, sizeof(attr.sockaddr));
      bound.length = bound.family() == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
    } else {
      bound = addr;
    }
    address_ = std::string(kPrefix) + formatTcpAddress(bound);
    rt_->listeners.insert(shared_from_this());
  }
  rt_->runDeferred();
}

void UcxListener::close() {
  {
    std::lock_guard<std::mutex> lock(rt_->mutex);
    if (!listener_) return;
    rt_->api.ucp_listener_destroy(listener_);
    listener_ = nullptr;
    auto self = shared_from_this();
    if (rt_->listeners.erase(self)) rt_->deferred.push_back([self] {});
  }
  rt_->runDeferred();
}

void UcxListener::onConnRequest(ucp_conn_request_h request) {
  if (!listener_) return;
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  std::string remote = "ucx://?";
  if (rt_->api.ucp_conn_request_query(request, &attr) == UCS_OK) {
    SockAddr client;
    std::memcpy(&client.storage, &attr.client_address, sizeof(attr.client_address));
    client.length = client.family() == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
    remote = std::string(kPrefix) + formatTcpAddress(client);
  }
  auto conn = std::make_shared<UcxConnection>(rt_, address_, remote);
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                 UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.conn_request = request;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = &epErrorCallback;
  p.err_handler.arg = conn.get();
  ucp_ep_h ep = nullptr;
  ucs_status_t st = rt_->api.ucp_ep_create(rt_->worker, &p, &ep);
  if (st != UCS_OK) {
    MOO_LOG(kError, "UCX: cannot accept a connection from ", remote, ": ",
            rt_->api.ucs_status_string(st));
    return;
  }
  auto onAccept = onAccept_;
  conn->acceptLocked(ep, [onAccept, conn] { onAccept(conn); });
}

std::unique_ptr<Context> createUcxContext(std::string& whyNot);

bool ucxSendRaw(const std::string& address, const std::string& bytes, double timeoutSeconds) {
  std::string whyNot;
  auto ctx = createUcxContext(whyNot);
  MOO_ENFORCE(ctx, "UCX is not available: ", whyNot);
  struct State {
    std::mutex m;
    std::condition_variable cv;
    bool connected = false, failed = false, closed = false;
    ConnectionPtr conn;
  };
  auto st = std::make_shared<State>();
  ctx->connect(address, [st](const Error& e, ConnectionPtr c) {
    std::lock_guard<std::mutex> l(st->m);
    if (e) {
      st->failed = true;
    } else {
      st->connected = true;
      st->conn = std::move(c);
    }
    st->cv.notify_all();
  });
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(timeoutSeconds));
  ConnectionPtr conn;
  {
    std::unique_lock<std::mutex> l(st->m);
    if (!st->cv.wait_until(l, deadline, [&] { return st->connected || st->failed; })) return false;
    if (st->failed) return false;
    conn = st->conn;
  }
  conn->start([](IncomingFrame&&) {},
              [st](const Error&) {
                std::lock_guard<std::mutex> l(st->m);
                st->closed = true;
                st->cv.notify_all();
              });
  static_cast<UcxConnection*>(conn.get())->sendRaw(bytes);
  {
    std::unique_lock<std::mutex> l(st->m);
    st->cv.wait_until(l, deadline, [&] { return st->closed; });
  }
  bool closedByPeer = conn->closed();
  conn->close(Error("done"));
  return closedByPeer;
}

std::unique_ptr<Context> createUcxContext(std::string& whyNot) {
  const UcxProbe& probe = UcxProbe::get();
  if (!probe.api) {
    whyNot = probe.whyNot;
    return nullptr;
  }
  return std::make_unique<UcxContext>(probe);
}

#else

std::unique_ptr<Context> createUcxContext(std::string& whyNot) {
#if defined(MOOLIB_WITHOUT_UCX)
  whyNot = "moolib was built with MOOLIB_UCX=0 (rebuild without it, with libucx-dev installed)";
#else
  whyNot = "moolib was built without UCX's headers (install libucx-dev and rebuild)";
#endif
  return nullptr;
}

bool ucxSendRaw(const std::string& address, const std::string& bytes, double timeoutSeconds) {
  throw Exception("moolib was built without UCX's headers");
}

#endif

}  // namespace moolib
