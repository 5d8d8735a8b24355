// Running Python from core threads, the discipline every binding file keeps:
// a core thread takes the GIL only through withPython, never while it holds a
// core lock, and lets go of Python objects only through releaseFromAnyThread
// (or holdObject), never where the core drops them (see gil.cc).
#pragma once

#include <cxxabi.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <initializer_list>
#include <memory>

namespace moolib::binding {

namespace py = pybind11;

// Where a core thread that would otherwise unwind through Python at
// interpreter exit stays (see gil.cc).
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

// Queues the release of a buffer export (view, may be null) and of a
// reference (object, may be null) for a thread that holds the GIL and no
// core lock. Safe on any thread, with or without the GIL.
void releaseFromAnyThread(Py_buffer* view, PyObject* object);

// Runs the queued releases (GIL held, no core lock held).
void drainReleases();

// A reference to a Python object that may be dropped on any thread.
std::shared_ptr<PyObject> holdObject(py::handle h);

// Set by _core.shutdown (moolib's atexit hook): core threads start no Python
// work after it.
extern std::atomic<bool> gExiting;

// Calls fn(args) with the GIL held; a forced unwind stops here.
PyObject* callParkingOnExit(PyObject* fn, PyObject* const* args, size_t n);

// fn(*args, **kwargs) (kwargs may be null) likewise.
PyObject* callParkingOnExit(PyObject* fn, PyObject* args, PyObject* kwargs);

// Every call into Python on a core thread goes through callParkingOnExit,
// whose catch sits right around the CPython call: a forced unwind at exit
// must not run the destructors of frames that own Python objects (pybind11's
// call operator owns its argument tuple), which would release them without
// the GIL. This one raises the Python error as py::error_already_set.
template <typename... Args>
py::object callOrThrow(py::handle fn, Args... args) {
  PyObject* argv[] = {py::handle(args).ptr()...};
  auto r = py::reinterpret_steal<py::object>(callParkingOnExit(fn.ptr(), argv, sizeof...(Args)));
  if (!r) throw py::error_already_set();
  return r;
}

// Takes the GIL on a core thread with the thread's own Python thread state;
// false (GIL not taken) once exiting.
bool enterPython();

// Runs body with the GIL on a core thread (or not at all once exiting),
// after the releases the core queued: core threads take the GIL only here,
// and never while they hold a core lock.
template <typename Body>
void withPython(Body&& body) {
  if (!enterPython()) return;
  struct Release {
    ~Release() { PyEval_SaveThread(); }
  } release;
  drainReleases();
  body();
}

// Calls a Python callable from a core thread body (GIL held); returns its
// result, or null with the Python error set.
py::object callFromCore(PyObject* fn, std::initializer_list<py::handle> args);

}  // namespace moolib::binding
