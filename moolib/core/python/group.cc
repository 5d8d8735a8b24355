// The binding of Broker and Group; moolib/group.py and moolib/broker.py add
// the Python-level API (nests, custom ops, the AllReduce handle).
#include "collectives/group.h"

#include <pybind11/stl.h>

#include "collectives/broker.h"
#include "python/future_type.h"
#include "python/gil.h"
#include "python/module.h"
#include "python/segments.h"

namespace moolib::binding {

using namespace pybind11::literals;

namespace {

// [(dtype name, [buffer, ...]), ...]: per element type, the parts whose
// concatenation this member contributes.
std::vector<TypedBuffer> typedBuffers(const py::list& items) {
  std::vector<TypedBuffer> out;
  out.reserve(items.size());
  for (auto item : items) {
    auto pair = item.cast<py::tuple>();
    MOO_ENFORCE(pair.size() == 2, "expected (dtype name, [buffers]) pairs");
    TypedBuffer b;
    b.dtype = dtypeFromName(pair[0].cast<std::string>());
    for (auto part : pair[1].cast<py::list>()) b.parts.push_back(exportSegment(part));
    out.push_back(std::move(b));
  }
  return out;
}

}  // namespace

void bindGroup(py::module_& m) {
  py::class_<Broker, std::shared_ptr<Broker>>(m, "Broker",
                                              "The broker service on an Rpc; see moolib.Broker.")
      .def(py::init([](const PyRpc& rpc) { return std::make_shared<Broker>(rpc.rpc); }),
           py::arg("rpc"))
      .def("update", &Broker::update, py::call_guard<GilRelease>(),
           "Drops members that missed their timeout.")
      .def(
          "groups",
          [](Broker& b) {
            py::dict out;
            for (auto& [name, reply] : b.groups()) {
              out[py::str(name)] =
                  py::dict("sync_id"_a = reply.syncId, "members"_a = reply.members);
            }
            return out;
          },
          "{group name: {'sync_id': int, 'members': [names]}}");

  py::class_<Group, std::shared_ptr<Group>>(m, "Group",
                                            "Group membership and collectives; see moolib.Group.")
      .def(py::init([](const PyRpc& rpc, const std::string& name) {
             return Group::create(rpc.rpc, name);
           }),
           py::arg("rpc"), py::arg("name"))
      .def("update", &Group::update, "Returns True once after each membership change.")
      .def("members", &Group::members, "Member names, the same list on every member.")
      .def("sync_id", &Group::syncId, "Changes whenever membership does.")
      .def("active", &Group::active,
           "Whether this peer is a member of the group as the broker last said.")
      .def("name", &Group::name)
      .def("set_timeout", &Group::setTimeout, py::arg("seconds"),
           "A member that has not called update() (or not reached the broker) this long leaves.")
      .def("get_timeout", &Group::timeout)
      .def("set_collective_timeout", &Group::setCollectiveTimeout, py::arg("seconds"),
           "An all-reduce not complete after this long fails on every member, naming the "
           "members it waits for (0: max(60 s, 2 x the group timeout)).")
      .def("get_collective_timeout", &Group::collectiveTimeout)
      .def("set_sort_order", &Group::setSortOrder, py::arg("order"),
           "Members are ordered by sort order, then join order.")
      .def("set_broker_name", &Group::setBrokerName, py::arg("name"))
      .def("_hold_membership", &Group::holdMembership, py::arg("hold"))
      .def("_resync", &Group::resync)
      .def("close", &Group::close, py::call_guard<GilRelease>(), "Leaves the group.")
      .def(
          "_all_reduce_sum",
          [](Group& g, const std::string& name, py::list items, uint64_t syncId,
             uint64_t structure) {
            return PyFuture{g.allReduce(name, typedBuffers(items), syncId, structure)};
          },
          py::arg("name"), py::arg("items"), py::arg("sync_id") = 0, py::arg("structure") = 0)
      .def(
          "_all_gather",
          [](Group& g, const std::string& name, py::handle data, py::list buffers,
             uint64_t syncId) {
            std::vector<OutSegment> segs{exportSegment(data)};
            for (auto b : buffers) segs.push_back(exportSegment(b));
            return PyFuture{g.allGather(name, std::move(segs), syncId)};
          },
          py::arg("name"), py::arg("data"), py::arg("buffers"), py::arg("sync_id") = 0);
}

}  // namespace moolib::binding
