// How the core serves a function defined in Python (see dispatch.cc).
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "rpc/rpc.h"

namespace moolib::binding {

namespace py = pybind11;

// How a function is called and answers, told when it is defined
// (moolib._core.Handler(fn, kind), kind its name here). The codec decodes
// every request and encodes every reply, whatever the kind.
enum class HandlerKind {
  // "call": fn(*args, **kwargs) returns the result (Rpc.define).
  kCall,
  // "responder": fn(responder, args, kwargs) answers through
  // responder.reply(result) or responder.error(text), then or later, from any
  // thread (define_deferred, define_queue, a batched define).
  kResponder,
  // "encoded": fn(args, kwargs) returns the result already encoded,
  // (data, buffers), as moolib.serialization.dumps makes it (a Publisher,
  // which encodes a snapshot once for every fetch).
  kEncoded,
};

// The core's handler of name, served as handler (a moolib._core.Handler)
// says. The moolib.Rpc that defines it owns the handler and the core holds a
// weak reference only, so that no strong reference to the function hides in
// the core: a function that refers back to its Rpc's owner makes a cycle the
// garbage collector sees whole.
Rpc::Handler pythonDispatcher(py::handle handler, const std::string& name);

// Binds moolib._core.Handler.
void bindHandler(py::module_& m);

}  // namespace moolib::binding
