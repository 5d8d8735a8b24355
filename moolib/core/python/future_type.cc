#include "python/future_type.h"

#include <structmember.h>

#include <algorithm>
#include <chrono>
#include <new>

#include "python/codec.h"
#include "python/errors.h"
#include "python/gil.h"
#include "python/module.h"
#include "python/segments.h"
#include "runtime/loop.h"

namespace moolib::binding {

namespace {

TimePoint deadlineFrom(double seconds) {
  if (seconds < 0) return kForever;
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// moolib.Future as a plain CPython type: one is made per call, and a
// pybind11 object costs an instance registry entry, a holder and its
// dispatcher on every method call, several times what the call itself costs
// in the core.
struct FutureObject {
  PyObject_HEAD PyObject* weakrefs;
  alignas(FuturePtr) unsigned char storage[sizeof(FuturePtr)];  // a FuturePtr
};
PyTypeObject* gFutureType = nullptr;

FuturePtr& stateOf(PyObject* self) {
  return *std::launder(
      reinterpret_cast<FuturePtr*>(reinterpret_cast<FutureObject*>(self)->storage));
}

void futureDealloc(PyObject* self) {
  auto* f = reinterpret_cast<FutureObject*>(self);
  if (f->weakrefs) PyObject_ClearWeakRefs(self);
  stateOf(self).~FuturePtr();
  PyTypeObject* type = Py_TYPE(self);
  PyObject_Free(self);
  Py_DECREF(type);
}

// The optional timeout argument (seconds, None: forever) of wait/result/exception.
bool parseTimeout(const char* method, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
                  double* seconds) {
  PyObject* timeout = Py_None;
  Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  if (nargs + nkw > 1) {
    PyErr_Format(PyExc_TypeError, "%s() takes at most 1 argument (timeout)", method);
    return false;
  }
  if (nargs == 1) timeout = args[0];
  if (nkw == 1) {
    if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "timeout") != 0) {
      PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", method,
                   PyTuple_GET_ITEM(kwnames, 0));
      return false;
    }
    timeout = args[0];
  }
  *seconds = -1;
  if (timeout == Py_None) return true;
  *seconds = PyFloat_AsDouble(timeout);
  return !(*seconds == -1 && PyErr_Occurred());
}

// Waits (GIL released) for a future unless it is done; false with TimeoutError set.
bool waitOrTimeout(const FuturePtr& state, double seconds) {
  if (state->done() || futureWait(state, seconds)) return true;
  PyErr_SetString(PyExc_TimeoutError, "the call did not complete within the wait timeout");
  return false;
}

PyObject* futureDone(PyObject* self, PyObject*) { return PyBool_FromLong(stateOf(self)->done()); }

PyObject* futureCancelled(PyObject* self, PyObject*) {
  return PyBool_FromLong(stateOf(self)->cancelled());
}

PyObject* futureCancel(PyObject* self, PyObject*) {
  return guarded([&] { return PyBool_FromLong(stateOf(self)->cancel()); });
}

PyObject* futureWaitMethod(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                           PyObject* kwnames) {
  double seconds;
  if (!parseTimeout("wait", args, nargs, kwnames, &seconds)) return nullptr;
  return guarded([&] { return PyBool_FromLong(futureWait(stateOf(self), seconds)); });
}

PyObject* futureResult(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  double seconds;
  if (!parseTimeout("result", args, nargs, kwnames, &seconds)) return nullptr;
  return guarded([&]() -> PyObject* {
    const FuturePtr& state = stateOf(self);
    if (!waitOrTimeout(state, seconds)) return nullptr;
    if (state->error()) return raiseError(state->error());
    return decodeValue(state->result()).release().ptr();
  });
}

PyObject* futureException(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                          PyObject* kwnames) {
  double seconds;
  if (!parseTimeout("exception", args, nargs, kwnames, &seconds)) return nullptr;
  return guarded([&]() -> PyObject* {
    const FuturePtr& state = stateOf(self);
    if (!waitOrTimeout(state, seconds)) return nullptr;
    if (!state->error()) Py_RETURN_NONE;
    return errorObject(state->error()).release().ptr();
  });
}

PyObject* futureSegments(PyObject* self, PyObject*) {
  return guarded([&] {
    const FuturePtr& state = stateOf(self);
    MOO_ENFORCE(state->done() && !state->error(), "the call has not succeeded");
    return wrapSegments(state->result()).release().ptr();
  });
}

PyObject* futureAddDoneCallback(PyObject* self, PyObject* fn) {
  if (!PyCallable_Check(fn)) {
    PyErr_SetString(PyExc_TypeError, "add_done_callback() takes a callable");
    return nullptr;
  }
  return guarded([&] {
    auto held = holdObject(fn);
    auto me = holdObject(self);
    stateOf(self)->onDone([held, me] {
      withPython([&] {
        if (!callFromCore(held.get(), {py::handle(me.get())})) PyErr_WriteUnraisable(held.get());
      });
    });
    Py_RETURN_NONE;
  });
}

PyMethodDef futureMethods[] = {
    {"done", futureDone, METH_NOARGS, "done($self, /)\n--\n\nWhether the call has completed."},
    {"wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(futureWaitMethod)),
     METH_FASTCALL | METH_KEYWORDS,
     "wait(timeout=None)\n--\n\nWaits until the call completes; returns whether it did within "
     "timeout."},
    {"result", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(futureResult)),
     METH_FASTCALL | METH_KEYWORDS,
     "result(timeout=None)\n--\n\nWaits for the call and returns its result; raises RpcError (the "
     "moolib.errors subclass of the failure) if it failed, TimeoutError if timeout seconds pass "
     "first (the call goes on)."},
    {"exception", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(futureException)),
     METH_FASTCALL | METH_KEYWORDS,
     "exception(timeout=None)\n--\n\nWaits for the call; returns its error as an RpcError (the "
     "moolib.errors subclass of the failure), or "
     "None."},
    {"cancel", futureCancel, METH_NOARGS,
     "cancel($self, /)\n--\n\nGives up on the call; returns False if it had already completed."},
    {"cancelled", futureCancelled, METH_NOARGS,
     "cancelled($self, /)\n--\n\nWhether the call was cancelled."},
    {"_segments", futureSegments, METH_NOARGS,
     "_segments($self, /)\n--\n\nThe raw segments of a successful result."},
    {"add_done_callback", futureAddDoneCallback, METH_O,
     "add_done_callback($self, fn, /)\n--\n\nCalls fn(future) on a core thread once the call "
     "completes."},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef futureMembers[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(FutureObject, weakrefs), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

}  // namespace

bool futureWait(const FuturePtr& state, double seconds) {
  TimePoint deadline = deadlineFrom(seconds);
  // Waits in slices so that Ctrl-C (a KeyboardInterrupt) gets through.
  while (true) {
    TimePoint slice = std::min(deadline, Clock::now() + std::chrono::milliseconds(100));
    bool done;
    {
      GilRelease nogil;
      done = state->wait(slice);
    }
    if (done) return true;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (Clock::now() >= deadline) return false;
  }
}

PyObject* wrapFuture(FuturePtr state) {
  auto* f = PyObject_New(FutureObject, gFutureType);
  if (!f) return nullptr;
  f->weakrefs = nullptr;
  new (f->storage) FuturePtr(std::move(state));
  return reinterpret_cast<PyObject*>(f);
}

void bindFuture(py::module_& m) {
  static PyType_Slot slots[] = {
      {Py_tp_dealloc, reinterpret_cast<void*>(futureDealloc)},
      {Py_tp_methods, futureMethods},
      {Py_tp_members, futureMembers},
      {Py_tp_doc, const_cast<char*>("The result of an asynchronous call, completed by the core.")},
      {0, nullptr}};
  static PyType_Spec spec = {"moolib._core.Future", int(sizeof(FutureObject)), 0,
                             Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, slots};
  gFutureType = addType(m, spec, "Future");
}

}  // namespace moolib::binding
