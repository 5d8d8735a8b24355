// moolib.Future: a core future as a plain CPython type (see future_type.cc).
#pragma once

#include <pybind11/pybind11.h>

#include <exception>

#include "runtime/future.h"

namespace moolib::binding {

namespace py = pybind11;

// A core future as the Python object moolib.Future.
struct PyFuture {
  FuturePtr state;
};

// A new moolib.Future over state (a new reference; null with the Python
// error set if it could not be made). PyFuture converts to one.
PyObject* wrapFuture(FuturePtr state);

// Waits for state (GIL released) until seconds pass (negative: forever);
// whether it completed. A signal's Python error is raised.
bool futureWait(const FuturePtr& state, double seconds);

// Runs body, turning C++ exceptions into the Python error they stand for.
template <typename Body>
PyObject* guarded(Body&& body) {
  try {
    return body();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// Makes the type and adds it to m as Future.
void bindFuture(py::module_& m);

}  // namespace moolib::binding

namespace pybind11::detail {

// Functions bound with pybind11 return a PyFuture as a moolib.Future (a
// plain CPython type; see future_type.cc). Futures are never taken as
// arguments.
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
