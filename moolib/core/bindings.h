// What the binding files share: the GIL discipline of core threads and the
// marshalling of futures and buffers. See bindings.cc.
#pragma once

#include <cxxabi.h>
#include <pybind11/pybind11.h>

#include "buffer.h"
#include "future.h"
#include "rpc.h"

namespace moolib::binding {

namespace py = pybind11;

// Where a core thread that would otherwise unwind through Python at
// interpreter exit stays (see bindings.cc).
[[noreturn]] void parkForever();

// Releases the GIL for a blocking section. Taking it back during finalization
// ends the thread with a forced unwind, which must not escape a destructor:
// the thread parks instead.
class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) {}
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;
  ~GilRelease() {
    try {
      PyEval_RestoreThread(state_);
    } catch (abi::__forced_unwind&) {
      parkForever();
    }
  }

 private:
  PyThreadState* state_;
};

// A core Rpc as the Python object moolib.Rpc. rpc shares ownership of an
// Owner (see bindings.cc) with every copy made for Python-side users of the
// Rpc (a Group, a Broker): when the last of them goes, the Rpc closes then
// and there, even while core threads still hold the Rpc itself.
struct PyRpc {
  std::shared_ptr<Rpc> rpc;
};

// A core future as the Python object moolib.Future.
struct PyFuture {
  FuturePtr state;
};

// A new moolib.Future over state (a new reference; null with the Python
// error set if it could not be made). PyFuture converts to one.
PyObject* wrapFuture(FuturePtr state);

// Takes a buffer export of a Python object; the view stays valid until the
// returned segment (and every copy of its keepalive) is gone. With writable,
// the object must allow writing through it.
OutSegment exportSegment(py::handle h, bool writable = false);

// bindings_errors.cc: the exception of a failed call, of the class its
// code maps to. raiseError sets it and returns null.
PyObject* raiseError(const Error& error);
py::object errorObject(const Error& error);
void bindErrors(py::module_& m);

// bindings_group.cc
void bindGroup(py::module_& m);

// bindings_replay.cc
void bindReplay(py::module_& m);

// bindings_shm.cc
void bindShm(py::module_& m);

}  // namespace moolib::binding

namespace pybind11::detail {

// Functions bound with pybind11 return a PyFuture as a moolib.Future (a
// plain CPython type; see bindings.cc). Futures are never taken as arguments.
template <>
struct type_caster<moolib::binding::PyFuture> {
 public:
  PYBIND11_TYPE_CASTER(moolib::binding::PyFuture, const_name("Future"));
  bool load(handle, bool) { return false; }
  static handle cast(const moolib::binding::PyFuture& f, return_value_policy, handle) {
    return moolib::binding::wrapFuture(f.state);
  }
};

}  // namespace pybind11::detail
