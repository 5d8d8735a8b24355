// Python objects referenced from core threads, and the Python thread states
// of the core threads that run Python.
#include "python/gil.h"

#include <chrono>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace moolib::binding {

namespace {

// Python objects referenced from core threads. The core drops its last
// reference to them wherever a frame is done with, often inside a
// connection's write lock, so it never releases one there: releasing runs
// Python code (deallocators, weakref callbacks, __del__), and that code may
// let go of the GIL (torch does while it frees a tensor). Another thread
// would then take the GIL and wait for the lock this one holds, while this
// one waits for the GIL. Releases wait in a queue instead, drained where a
// thread holds the GIL and no core lock: whenever a core thread takes the GIL
// (withPython), after a call is handed to the core, and in a pending call the
// interpreter runs.
class DeferredReleases {
 public:
  void add(Py_buffer* view, PyObject* object) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      items_.push_back({view, object});
      pending_.store(true, std::memory_order_release);
      if (scheduled_) return;
      scheduled_ = true;
    }
    int queued = Py_AddPendingCall(
        [](void*) {
          instance().drain();
          return 0;
        },
        nullptr);
    if (queued != 0) {
      // The interpreter's queue is full: the next release tries again (and
      // a drain at a safe point takes these meanwhile).
      std::lock_guard<std::mutex> lock(mutex_);
      scheduled_ = false;
    }
  }
  // GIL held, no core lock held.
  void drain() {
    if (!pending_.load(std::memory_order_acquire)) return;
    std::vector<std::pair<Py_buffer*, PyObject*>> items;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      items.swap(items_);
      pending_.store(false, std::memory_order_relaxed);
      scheduled_ = false;
    }
    for (auto& [view, object] : items) {
      if (view) {
        PyBuffer_Release(view);
        std::unique_ptr<Py_buffer> owned(view);
      }
      Py_XDECREF(object);
    }
  }
  static DeferredReleases& instance() {
    static auto* d = new DeferredReleases();  // leaked: used until the process ends
    return *d;
  }

 private:
  std::mutex mutex_;
  std::vector<std::pair<Py_buffer*, PyObject*>> items_;
  std::atomic<bool> pending_{false};
  bool scheduled_ = false;
};

// Running Python on core threads.
//
// Each core thread keeps its Python thread state for life: creating and
// destroying one per call costs an mmap/munmap of its frame stack each time
// (and the TLB shootdowns that come with it).
//
// At interpreter exit, a thread that takes the GIL after finalization began
// is ended by CPython with pthread_exit, a forced unwind. Unwinding our frames
// would run destructors that touch Python objects without the GIL, so such a
// thread is parked instead (what CPython 3.14 itself does): the process exits
// around it. After moolib's atexit hook, core threads do not start Python
// work at all.

// The Python thread state of a thread that runs Python for the core. One we
// created (a core thread's) is freed when the thread ends, since a pool that
// shrinks ends threads, unless the interpreter is going away. A Python
// thread's own state (one serving I/O while it waits) is Python's to free.
struct CoreThreadState {
  PyThreadState* state = nullptr;
  bool owned = false;
  ~CoreThreadState() {
    if (!state || !owned || gExiting.load(std::memory_order_relaxed)) return;
    try {
      PyEval_RestoreThread(state);
      // Balances the PyGILState_Ensure that made it: clears and deletes it,
      // releasing the GIL.
      PyGILState_Release(PyGILState_UNLOCKED);
    } catch (abi::__forced_unwind&) {
      parkForever();
    }
  }
};
thread_local CoreThreadState tlsThreadState;

}  // namespace

std::atomic<bool> gExiting{false};

[[noreturn]] void parkForever() {
  while (true) std::this_thread::sleep_for(std::chrono::hours(1));
}

void releaseFromAnyThread(Py_buffer* view, PyObject* object) {
  if (Py_IsInitialized() == 0) return;
  DeferredReleases::instance().add(view, object);
}

std::shared_ptr<PyObject> holdObject(py::handle h) {
  PyObject* o = h.ptr();
  Py_INCREF(o);
  return std::shared_ptr<PyObject>(o, [](PyObject* p) { releaseFromAnyThread(nullptr, p); });
}

void drainReleases() { DeferredReleases::instance().drain(); }

PyObject* callParkingOnExit(PyObject* fn, PyObject* const* args, size_t n) {
  try {
    return PyObject_Vectorcall(fn, args, n, nullptr);
  } catch (abi::__forced_unwind&) {
    parkForever();
  }
}

PyObject* callParkingOnExit(PyObject* fn, PyObject* args, PyObject* kwargs) {
  try {
    return PyObject_Call(fn, args, kwargs);
  } catch (abi::__forced_unwind&) {
    parkForever();
  }
}

bool enterPython() {
  if (gExiting.load(std::memory_order_relaxed)) return false;
  try {
    if (tlsThreadState.state) {
      PyEval_RestoreThread(tlsThreadState.state);
    } else {
      tlsThreadState.owned = PyGILState_GetThisThreadState() == nullptr;
      PyGILState_Ensure();
      tlsThreadState.state = PyThreadState_Get();
    }
  } catch (abi::__forced_unwind&) {
    parkForever();
  }
  return true;
}

py::object callFromCore(PyObject* fn, std::initializer_list<py::handle> args) {
  std::vector<PyObject*> argv;
  for (auto a : args) argv.push_back(a.ptr());
  return py::reinterpret_steal<py::object>(callParkingOnExit(fn, argv.data(), argv.size()));
}

}  // namespace moolib::binding
