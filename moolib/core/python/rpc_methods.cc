// Rpc.async_ and Rpc.sync, the calls themselves: the per-call path from
// Python into the core.
#include "python/codec.h"
#include "python/errors.h"
#include "python/future_type.h"
#include "python/gil.h"
#include "python/module.h"

namespace moolib::binding {

namespace {

// Rpc.async_ and Rpc.sync as vectorcall methods: (peer, fn, *args, **kwargs)
// parsed here rather than by pybind11, which builds an args tuple and a
// kwargs dict and converts both names to std::string on every call.
FuturePtr callFromArgs(const char* method, PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                       PyObject* kwnames, bool waitNext) {
  if (nargs < 2) {
    PyErr_Format(PyExc_TypeError, "%s() takes the peer's name and the function's name first",
                 method);
    throw py::error_already_set();
  }
  for (int i : {0, 1}) {
    if (!PyUnicode_Check(args[i])) {
      PyErr_Format(PyExc_TypeError, "%s(): the %s's name must be a str, got %s", method,
                   i == 0 ? "peer" : "function", Py_TYPE(args[i])->tp_name);
      throw py::error_already_set();
    }
  }
  Py_ssize_t peerSize, functionSize;
  const char* peer = PyUnicode_AsUTF8AndSize(args[0], &peerSize);
  if (!peer) throw py::error_already_set();
  const char* function = PyUnicode_AsUTF8AndSize(args[1], &functionSize);
  if (!function) throw py::error_already_set();
  // No peer or function has such a name (set_name and define take 1 to 1024
  // characters): the call would only wait out its timeout.
  for (int i : {0, 1}) {
    Py_ssize_t size = i == 0 ? peerSize : functionSize;
    if (size == 0 || size > 1024) {
      PyErr_Format(PyExc_ValueError, "%s(): the %s's name must be 1 to 1024 characters, got %zd",
                   method, i == 0 ? "peer" : "function", size);
      throw py::error_already_set();
    }
  }
  PyRpc& rpc = py::cast<PyRpc&>(py::handle(self));
  std::vector<OutSegment> segs = encodeCall(args + 2, nargs - 2, kwnames);
  // The GIL stays held: a call never blocks (sockets are non-blocking) and no
  // core lock is ever held while waiting for the GIL (the core releases no
  // Python object itself: DeferredReleases), so this cannot deadlock, and it
  // saves a GIL hand-off per call.
  FuturePtr state =
      rpc.rpc->call(std::string(peer, size_t(peerSize)),
                    std::string(function, size_t(functionSize)), std::move(segs), waitNext);
  // What the send finished with (this call's arguments, when written at once)
  // is released before the caller goes on, as if the core held no reference.
  drainReleases();
  return state;
}

PyObject* rpcAsync(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  return guarded([&] {
    return wrapFuture(
        callFromArgs("async_", self, args, PyVectorcall_NARGS(nargsf), kwnames, false));
  });
}

PyObject* rpcSync(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  return guarded([&]() -> PyObject* {
    FuturePtr state = callFromArgs("sync", self, args, PyVectorcall_NARGS(nargsf), kwnames, true);
    futureWait(state, -1);
    if (state->error()) return raiseError(state->error());
    return decodeValue(state->result()).release().ptr();
  });
}

// Adds a METH_FASTCALL | METH_KEYWORDS method to a pybind11 class.
void addFastMethod(py::handle cls, PyMethodDef* def) {
  PyObject* descr = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), def);
  if (!descr) throw py::error_already_set();
  py::setattr(cls, def->ml_name, py::reinterpret_steal<py::object>(descr));
}

PyMethodDef rpcAsyncDef = {
    "async_", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rpcAsync)),
    METH_FASTCALL | METH_KEYWORDS,
    "async_(peer, fn, *args, **kwargs)\n--\n\nCalls fn on peer; returns a Future for the result."};
PyMethodDef rpcSyncDef = {
    "sync", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rpcSync)),
    METH_FASTCALL | METH_KEYWORDS,
    "sync(peer, fn, *args, **kwargs)\n--\n\nCalls fn on peer and waits for the result (raises "
    "RpcError on failure)."};

}  // namespace

void bindRpcCalls(py::handle cls) {
  addFastMethod(cls, &rpcAsyncDef);
  addFastMethod(cls, &rpcSyncDef);
}

}  // namespace moolib::binding
