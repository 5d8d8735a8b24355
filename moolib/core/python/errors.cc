// Failed calls as Python exceptions: moolib._core.RpcError, the base, and the
// class of each ErrorCode, which moolib/errors.py defines and registers here.
// Every failure the core reports to Python goes through raiseError or
// errorObject, so a code meets its class in this file only.
#include "python/errors.h"

#include <array>
#include <utility>

namespace moolib::binding {

namespace {

struct RpcErrorTag {};
PyObject* gRpcError = nullptr;  // moolib.RpcError
// Strong references, never released: exceptions may be raised until exit.
std::array<PyObject*, size_t(ErrorCode::kCount)> gClasses{};

PyObject* classOf(ErrorCode code) {
  PyObject* cls = size_t(code) < gClasses.size() ? gClasses[size_t(code)] : nullptr;
  return cls ? cls : gRpcError;
}

// The message as str: a peer's text need not be valid UTF-8.
py::str messageOf(const Error& error) {
  const std::string& m = error.what();
  PyObject* s = PyUnicode_DecodeUTF8(m.data(), Py_ssize_t(m.size()), "replace");
  if (!s) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(s);
}

}  // namespace

PyObject* raiseError(const Error& error) {
  PyErr_SetObject(classOf(error.code()), messageOf(error).ptr());
  return nullptr;
}

py::object errorObject(const Error& error) {
  return py::handle(classOf(error.code()))(messageOf(error));
}

void bindErrors(py::module_& m) {
  // Leaked: destroying it at exit would run after the interpreter is gone.
  static auto& rpcError = *new py::exception<RpcErrorTag>(m, "RpcError", PyExc_RuntimeError);
  rpcError.doc() =
      "A call or collective failed. The base of every error in moolib.errors; the class of "
      "failures none of its subclasses names.";
  gRpcError = rpcError.ptr();

  m.def(
      "_set_error_classes",
      [](const py::dict& classes) {
        for (auto [key, cls] : classes) {
          auto name = key.cast<std::string>();
          size_t code = 1;
          while (code != gClasses.size() && name != errorCodeName(ErrorCode(code))) ++code;
          MOO_ENFORCE(code != gClasses.size() && ErrorCode(code) != ErrorCode::kFailed,
                      "no error code is named '", name, "'");
          int sub = PyObject_IsSubclass(cls.ptr(), gRpcError);
          if (sub < 0) throw py::error_already_set();
          MOO_ENFORCE(sub == 1, "the class of error code '", name, "' must derive from RpcError");
          Py_XDECREF(std::exchange(gClasses[code], cls.inc_ref().ptr()));
        }
      },
      py::arg("classes"),
      "Registers {code name: class} (names in moolib/core/runtime/error.h, errorCodeName): a "
      "failure "
      "of that code raises that subclass of RpcError. Unregistered codes raise RpcError.");
}

}  // namespace moolib::binding
