// The parts of moolib._core that module.cc assembles, and the Python object
// moolib.Rpc they share.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "rpc/rpc.h"

namespace moolib::binding {

namespace py = pybind11;

// A core Rpc as the Python object moolib.Rpc. rpc shares ownership of an
// Owner (see rpc_type.cc) with every copy made for Python-side users of the
// Rpc (a Group, a Broker): when the last of them goes, the Rpc closes then
// and there, even while core threads still hold the Rpc itself.
struct PyRpc {
  std::shared_ptr<Rpc> rpc;
};

// module.cc: makes the type spec describes and adds it to m as name (the
// module keeps it); throws the Python error when it cannot.
PyTypeObject* addType(py::module_& m, PyType_Spec& spec, const char* name);

// rpc_type.cc: Responder and Rpc.
void bindRpc(py::module_& m);

// rpc_methods.cc: Rpc.async_ and Rpc.sync, added to the class cls.
void bindRpcCalls(py::handle cls);

// log_sink.cc: the log level and sink.
void bindLogging(py::module_& m);

// group.cc: Broker and Group.
void bindGroup(py::module_& m);

// replay.cc: Replay.
void bindReplay(py::module_& m);

// shm.cc: ShmRegion.
void bindShm(py::module_& m);

}  // namespace moolib::binding
