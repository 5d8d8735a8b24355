// moolib._core.Rpc and Responder: a core Rpc's life, names, transports and
// function table as a Python class.
#include <pybind11/stl.h>

#include "python/codec.h"
#include "python/dispatch.h"
#include "python/gil.h"
#include "python/module.h"
#include "runtime/logging.h"

namespace moolib::binding {

using namespace pybind11::literals;

namespace {

// debug_info() as plain dicts and lists.
py::dict toPython(const ConnectionInfo& c) {
  return py::dict("transport"_a = c.transport, "local"_a = c.local, "remote"_a = c.remote,
                  "outgoing"_a = c.outgoing, "bytes_sent"_a = c.bytesSent,
                  "bytes_received"_a = c.bytesReceived, "why"_a = c.why, "lanes"_a = c.lanes);
}

py::dict toPython(const PeerInfo& p) {
  py::list connections;
  for (auto& c : p.connections) connections.append(toPython(c));
  return py::dict(
      "name"_a = p.name, "same_host"_a = p.sameHost, "addresses"_a = p.addresses,
      "queued_calls"_a = p.queuedCalls, "connections"_a = connections,
      "transport"_a = p.transport.empty() ? py::object(py::none()) : py::str(p.transport),
      "chosen"_a = p.chosen.empty() ? py::object(py::none()) : py::str(p.chosen), "why"_a = p.why);
}

py::dict toPython(const DebugInfo& info) {
  py::list peers;
  for (auto& p : info.peers) peers.append(toPython(p));
  // Every registered transport: whether it is viable here, its priority and
  // domain, or why not.
  py::dict available;
  for (auto& t : info.available) {
    available[py::str(t.name)] =
        t.available
            ? py::dict("available"_a = true, "priority"_a = t.priority, "domain"_a = t.domain)
            : py::dict("available"_a = false, "why"_a = t.why);
  }
  return py::dict("name"_a = info.name, "listening"_a = info.listening,
                  "transport_status"_a = available, "advertised"_a = info.advertised,
                  "transports"_a = info.transports, "pending_calls"_a = info.pendingCalls,
                  "unidentified_connections"_a = info.unidentifiedConnections,
                  "functions"_a = info.functions, "peers"_a = peers);
}

// What the Python Rpc objects of one core Rpc, and the Groups and Brokers
// made on them, share. Core threads hold the Rpc itself, for as long as a
// function runs or a timer fires; when the last Python-side share goes
// (the object deleted or garbage collected without close()), the Owner closes
// the Rpc right there, so that its addresses are free and its peers see it
// gone by the time `del` or gc.collect() returns.
PyRpc createRpc() {
  struct Owner {
    std::shared_ptr<Rpc> rpc;
    explicit Owner(std::shared_ptr<Rpc> r) : rpc(std::move(r)) {}
    Owner(const Owner&) = delete;
    Owner& operator=(const Owner&) = delete;
    ~Owner() {
      // close() waits for no core thread and never for the GIL: it is safe
      // wherever the last share drops, on a core thread too.
      if (rpc->inherited()) return;
      try {
        rpc->close();
      } catch (const std::exception& e) {
        MOO_LOG(kError, "closing a dropped Rpc: ", e.what());
      }
    }
  };
  auto owner = std::make_shared<Owner>(Rpc::create());
  Rpc* rpc = owner->rpc.get();
  return PyRpc{std::shared_ptr<Rpc>(std::move(owner), rpc)};
}

// A member function of Rpc as a method of PyRpc.
template <typename R, typename... A>
auto onRpc(R (Rpc::*method)(A...)) {
  return [method](PyRpc& self, A... args) -> R {
    return ((*self.rpc).*method)(std::forward<A>(args)...);
  };
}
template <typename R, typename... A>
auto onRpc(R (Rpc::*method)(A...) const) {
  return [method](PyRpc& self, A... args) -> R {
    return ((*self.rpc).*method)(std::forward<A>(args)...);
  };
}

}  // namespace

void bindRpc(py::module_& m) {
  py::class_<Responder, std::shared_ptr<Responder>>(m, "Responder")
      .def(
          "reply",
          [](Responder& r, py::handle value) {
            std::vector<OutSegment> segs;
            try {
              segs = encodeValue(value);
            } catch (py::error_already_set& e) {
              std::string text = describeError(e);
              GilRelease nogil;
              r.error(text);
              return;
            }
            GilRelease nogil;
            r.reply(std::move(segs));
          },
          py::arg("value"),
          "Answers the call with value, encoded as every reply is; a value that cannot be "
          "encoded fails the call instead.")
      .def(
          "error",
          [](Responder& r, const std::string& message) {
            GilRelease nogil;
            r.error(message);
          },
          py::arg("message"), "Fails the call with message.")
      .def_property_readonly("peer", &Responder::peer)
      .def_property_readonly("function", &Responder::function);

  py::class_<PyRpc> rpcClass(m, "Rpc", "The C++ peer; moolib.Rpc adds the Python-level API.");
  bindRpcCalls(rpcClass);
  rpcClass.def(py::init(&createRpc))
      .def("set_name", onRpc(&Rpc::setName), py::arg("name"),
           "Names this peer (unique in its group of peers); before listen or connect.")
      .def("get_name", onRpc(&Rpc::name))
      .def("listen", onRpc(&Rpc::listen), py::call_guard<GilRelease>(), py::arg("address"),
           "Listens on address (host:port, port 0 for any; ucx://host:port for UCX); "
           "returns the address bound.")
      .def("connect", onRpc(&Rpc::connect), py::call_guard<GilRelease>(), py::arg("address"),
           "Connects to the peer at address, and again whenever the link drops.")
      .def("set_timeout", onRpc(&Rpc::setTimeout), py::arg("seconds"),
           "Seconds a call may take before it fails with RpcTimeoutError (default 10).")
      .def("get_timeout", onRpc(&Rpc::timeout))
      .def("set_transports", onRpc(&Rpc::setTransports), py::arg("transports"),
           "Restricts links to these transports (of shm, tcp, ucx), in any order.")
      .def("set_auth_key", onRpc(&Rpc::setAuthKey), py::arg("key"),
           "Peers must share this key to link (docs/library.md, \"Security\").")
      .def(
          "_define_owned",
          [](PyRpc& self, const std::string& name, py::handle handler) {
            self.rpc->define(name, pythonDispatcher(handler, name));
          },
          py::arg("name"), py::arg("handler"),
          "Defines name as handler (a Handler), which the caller keeps: the core holds a weak "
          "reference to it.")
      .def("undefine", onRpc(&Rpc::undefine), py::call_guard<GilRelease>(), py::arg("name"))
      .def("_linked_to", onRpc(&Rpc::linkedTo), py::arg("peer"),
           "Whether a link to the peer is up now (a peer whose links all closed is not).")
      .def("close", onRpc(&Rpc::close), py::call_guard<GilRelease>())
      .def("debug_info", [](PyRpc& self) {
        DebugInfo info;
        {
          GilRelease nogil;
          info = self.rpc->debugInfo();
        }
        return toPython(info);
      });
}

}  // namespace moolib::binding
