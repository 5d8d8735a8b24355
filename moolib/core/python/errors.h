// Failed calls as Python exceptions (see errors.cc).
#pragma once

#include <pybind11/pybind11.h>

#include "runtime/error.h"

namespace moolib::binding {

namespace py = pybind11;

// The exception of a failed call, of the class its code maps to. raiseError
// sets it and returns null.
PyObject* raiseError(const Error& error);
py::object errorObject(const Error& error);

// Binds RpcError and _set_error_classes.
void bindErrors(py::module_& m);

}  // namespace moolib::binding
