// How the core runs a function defined in Python (see dispatch.cc).
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "rpc.h"

namespace moolib::binding {

namespace py = pybind11;

// Calls handler(responder, segments) (GIL held). A handler may return
// (data, buffers) instead of replying itself: the reply then goes out after
// the arguments are released, so shared-memory segments are free for reuse
// by the time the caller's next call needs one.
void callHandler(py::handle handler, const std::shared_ptr<Responder>& responder,
                 std::vector<BufferPtr>& args);

// The core's handler of a function defined in Python: it finds the handler,
// owner._handlers[name], through a weak reference to the moolib.Rpc object
// that owns it, so that no strong reference to the handler hides in the core
// (a handler referring back to its Rpc's owner makes a cycle that the garbage
// collector sees whole).
Rpc::Handler pythonDispatcher(py::handle ownerRef, const std::string& name);

}  // namespace moolib::binding
