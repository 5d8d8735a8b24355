// The codec of calls made and served from C: how a value becomes the
// segments of a request or a reply, and back (see codec.cc).
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "buffer.h"

namespace moolib::binding {

namespace py = pybind11;

// The serialization functions of moolib.serialization, registered at import.
struct Codec {
  py::object dumps, loads;
};
Codec& codec();

// The calls that dominate RPC traffic carry a few scalars or nothing and
// return None. They skip the Python-level codec (moolib.serialization): its
// dumps() first walks the object in Python to see whether a plain pickle
// will do, which costs several times the pickling itself. Here that walk is
// done in C, plain objects go straight to pickle.dumps/loads, and the two
// commonest payloads, the arguments of a call without any and a None
// result, are constants. What is not plain takes the codec as before.
struct FastCodec {
  py::object dumps, loads;           // pickle.dumps, pickle.loads
  std::string emptyCall, noneValue;  // pickle of ((), {}) and of None, protocol 5
  py::object plainType, describe;    // moolib.rpc._Plain, moolib.rpc._describe
  py::object handlersName;           // "_handlers"
};
FastCodec& fastCodec();

// Fills in fastCodec() at import, never lazily: a static initialized on
// first use by Python code would deadlock a thread waiting for that
// initialization with the GIL held against the initializing thread, which
// may drop the GIL (running importlib, say) and need it back.
void initFastCodec();

// Whether obj is a small nest of scalars that pickle alone encodes as the
// codec would (moolib.serialization._is_plain, same rules).
bool isPlain(PyObject* obj, int depth);

// Encodes value as moolib.serialization.dumps would; its segments.
std::vector<OutSegment> encodeValue(py::handle value);

// The value that segments encode (None for none at all).
py::object decodeSegments(const std::vector<BufferPtr>& segs);

// What the caller sees of the Python exception e: moolib.rpc._describe of
// it (type, message, remote traceback), as the Python-level handlers send.
std::string describeError(py::error_already_set& e);

// Binds _is_plain, set_codec and set_dispatch.
void bindCodec(py::module_& m);

}  // namespace moolib::binding
