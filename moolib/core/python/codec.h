// The codec: how the arguments of a call become the segments of its request,
// and a result those of its reply, and back. Every request and reply the core
// sends or receives for Python goes through it, whichever kind of handler
// serves the call (see codec.cc).
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "runtime/buffer.h"

namespace moolib::binding {

namespace py = pybind11;

// What the codec calls. Calls mostly carry a few scalars or nothing and
// return None: those skip moolib.serialization (its Pickler costs several
// times the pickling itself) for pickle.dumps/loads, and the two commonest
// payloads, the arguments of a call without any and a None result, are
// constants. Everything else goes through moolib.serialization. The bytes on
// the wire are the same either way.
struct Codec {
  py::object pickleDumps, pickleLoads;  // pickle.dumps, pickle.loads
  std::string emptyCall, noneValue;     // pickle of ((), {}) and of None, protocol 5
  py::object dumps, loads;              // moolib.serialization.dumps, loads
  py::object describe;                  // moolib.rpc._describe: the text of a failure
};
Codec& codec();

// Fills in pickle's half of codec() at import, never lazily: a static
// initialized on first use by Python code would deadlock a thread waiting
// for that initialization with the GIL held against the initializing thread,
// which may drop the GIL (running importlib, say) and need it back.
void initCodec();

// Whether obj is a small nest of scalars, which pickle alone encodes as
// moolib.serialization.dumps would: the one copy of the rule (_core._is_plain
// to Python).
bool isPlain(PyObject* obj, int depth);

// The request of a call of fn(*args, **kwargs), given as a vectorcall's
// arguments (kwnames may be null).
std::vector<OutSegment> encodeCall(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames);

// A decoded request: args is a tuple, kwargs a dict or null when empty.
struct Call {
  py::object args, kwargs;
};
Call decodeCall(const std::vector<BufferPtr>& segs);

// The reply of a call that returned value.
std::vector<OutSegment> encodeValue(py::handle value);

// The value of a reply (None for no segments at all).
py::object decodeValue(const std::vector<BufferPtr>& segs);

// What the caller sees of the Python exception e: moolib.rpc._describe of
// it (type, message, remote traceback).
std::string describeError(py::error_already_set& e);

// Binds _is_plain and set_codec.
void bindCodec(py::module_& m);

}  // namespace moolib::binding
