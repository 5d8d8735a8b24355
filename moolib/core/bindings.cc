// The Python binding: marshalling only. The public API is moolib/rpc.py.
#include "bindings.h"

#include <cxxabi.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <structmember.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <new>
#include <thread>

#include "host.h"
#include "logging.h"
#include "rpc.h"
#include "spin.h"
#include "transport/ucx/ucx_api.h"

namespace py = pybind11;
using namespace pybind11::literals;
using namespace moolib;
using namespace moolib::binding;

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

void releaseFromAnyThread(Py_buffer* view, PyObject* object) {
  if (Py_IsInitialized() == 0) return;
  DeferredReleases::instance().add(view, object);
}

// A reference to a Python object that may be dropped on any thread.
std::shared_ptr<PyObject> holdObject(py::handle h) {
  PyObject* o = h.ptr();
  Py_INCREF(o);
  return std::shared_ptr<PyObject>(o, [](PyObject* p) { releaseFromAnyThread(nullptr, p); });
}

}  // namespace

namespace moolib::binding {

OutSegment exportSegment(py::handle h, bool writable) {
  auto view = std::make_unique<Py_buffer>();
  int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(h.ptr(), view.get(), flags) != 0) throw py::error_already_set();
  OutSegment s;
  s.data = static_cast<const uint8_t*>(view->buf);
  s.size = size_t(view->len);
  Py_buffer* raw = view.release();
  s.keepalive = std::shared_ptr<const void>(raw, [](const void* p) {
    releaseFromAnyThread(const_cast<Py_buffer*>(static_cast<const Py_buffer*>(p)), nullptr);
  });
  return s;
}

[[noreturn]] void parkForever() {
  while (true) std::this_thread::sleep_for(std::chrono::hours(1));
}

}  // namespace moolib::binding

namespace {

std::vector<OutSegment> exportSegments(py::handle data, const py::list& buffers) {
  std::vector<OutSegment> segs;
  segs.reserve(1 + buffers.size());
  segs.push_back(exportSegment(data));
  for (auto b : buffers) segs.push_back(exportSegment(b));
  return segs;
}

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
std::atomic<bool> gExiting{false};

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

// Calls fn(args) with the GIL held; a forced unwind stops here.
PyObject* callParkingOnExit(PyObject* fn, PyObject* const* args, size_t n) {
  try {
    return PyObject_Vectorcall(fn, args, n, nullptr);
  } catch (abi::__forced_unwind&) {
    parkForever();
  }
}

// fn(*args, **kwargs) (kwargs may be null) likewise.
PyObject* callParkingOnExit(PyObject* fn, PyObject* args, PyObject* kwargs) {
  try {
    return PyObject_Call(fn, args, kwargs);
  } catch (abi::__forced_unwind&) {
    parkForever();
  }
}

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

// Runs body with the GIL on a core thread (or not at all once exiting),
// after the releases the core queued: core threads take the GIL only here,
// and never while they hold a core lock.
template <typename Body>
void withPython(Body&& body) {
  if (gExiting.load(std::memory_order_relaxed)) return;
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
  struct Release {
    ~Release() { PyEval_SaveThread(); }
  } release;
  DeferredReleases::instance().drain();
  body();
}

// Calls a Python callable from a core thread body (GIL held); returns its
// result, or null with the Python error set.
py::object callFromCore(PyObject* fn, std::initializer_list<py::handle> args) {
  std::vector<PyObject*> argv;
  for (auto a : args) argv.push_back(a.ptr());
  return py::reinterpret_steal<py::object>(callParkingOnExit(fn, argv.data(), argv.size()));
}

// A received segment as a writable Python buffer.
struct PyBuffer {
  BufferPtr buffer;
};

py::list wrapSegments(const std::vector<BufferPtr>& segs) {
  py::list out(segs.size());
  for (size_t i = 0; i != segs.size(); ++i) out[i] = py::cast(PyBuffer{segs[i]});
  return out;
}

TimePoint deadlineFrom(double seconds) {
  if (seconds < 0) return kForever;
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Waits for state until seconds pass (negative: forever); whether it completed.
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

// debug_info() as plain dicts and lists.
py::dict toPython(const ConnectionInfo& c) {
  return py::dict("transport"_a = c.transport, "local"_a = c.local, "remote"_a = c.remote,
                  "outgoing"_a = c.outgoing, "bytes_sent"_a = c.bytesSent,
                  "bytes_received"_a = c.bytesReceived, "why"_a = c.why);
}

py::dict toPython(const PeerInfo& p) {
  py::list connections;
  for (auto& c : p.connections) connections.append(toPython(c));
  return py::dict(
      "name"_a = p.name, "same_host"_a = p.sameHost, "addresses"_a = p.addresses,
      "queued_calls"_a = p.queuedCalls, "connections"_a = connections,
      "transport"_a = p.transport.empty() ? py::object(py::none()) : py::str(p.transport),
      "chosen"_a = p.chosen.empty() ? py::object(py::none()) : py::str(p.chosen), "why"_a = p.why);
}

py::dict toPython(const DebugInfo& info) {
  py::list peers;
  for (auto& p : info.peers) peers.append(toPython(p));
  // Every registered transport: whether it is viable here, its priority and
  // domain, or why not.
  py::dict available;
  for (auto& t : info.available) {
    available[py::str(t.name)] =
        t.available
            ? py::dict("available"_a = true, "priority"_a = t.priority, "domain"_a = t.domain)
            : py::dict("available"_a = false, "why"_a = t.why);
  }
  return py::dict("name"_a = info.name, "listening"_a = info.listening,
                  "transport_status"_a = available, "advertised"_a = info.advertised,
                  "transports"_a = info.transports, "pending_calls"_a = info.pendingCalls,
                  "unidentified_connections"_a = info.unidentifiedConnections,
                  "functions"_a = info.functions, "peers"_a = peers);
}

// The serialization functions of moolib.serialization, registered at import.
struct Codec {
  py::object dumps, loads;
};
Codec& codec() {
  static auto* c = new Codec();  // leaked: lives as long as the interpreter
  return *c;
}

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
// Filled in by initFastCodec at import, never lazily: a static initialized
// on first use by Python code would deadlock a thread waiting for that
// initialization with the GIL held against the initializing thread, which
// may drop the GIL (running importlib, say) and need it back.
FastCodec& fastCodec() {
  static auto* c = new FastCodec();  // leaked: lives as long as the interpreter
  return *c;
}

void initFastCodec() {
  FastCodec& f = fastCodec();
  auto pickle = py::module_::import("pickle");
  f.dumps = pickle.attr("dumps");
  f.loads = pickle.attr("loads");
  f.emptyCall = f.dumps(py::make_tuple(py::tuple(), py::dict()), 5).cast<std::string>();
  f.noneValue = f.dumps(py::none(), 5).cast<std::string>();
  f.handlersName = py::str("_handlers");
}

// Whether obj is a small nest of scalars that pickle alone encodes as the
// codec would (moolib.serialization._is_plain, same rules).
bool isPlain(PyObject* obj, int depth) {
  PyTypeObject* t = Py_TYPE(obj);
  if (obj == Py_None || t == &PyBool_Type || t == &PyLong_Type || t == &PyFloat_Type ||
      t == &PyComplex_Type || t == &PyUnicode_Type || t == &PyBytes_Type) {
    return true;
  }
  if (depth == 0) return false;
  if (t == &PyTuple_Type || t == &PyList_Type) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    if (n > 16) return false;
    PyObject** items = PySequence_Fast_ITEMS(obj);
    for (Py_ssize_t i = 0; i != n; ++i) {
      if (!isPlain(items[i], depth - 1)) return false;
    }
    return true;
  }
  if (t == &PyDict_Type) {
    if (PyDict_GET_SIZE(obj) > 16) return false;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(obj, &pos, &key, &value)) {
      if (Py_TYPE(key) != &PyUnicode_Type || !isPlain(value, depth - 1)) return false;
    }
    return true;
  }
  return false;
}

// A segment over bytes the core owns: no buffer export to release later
// (from whichever thread sends it) for a stream of a few dozen bytes.
OutSegment ownedSegment(std::string bytes) {
  auto held = std::make_shared<const std::string>(std::move(bytes));
  OutSegment s;
  s.data = reinterpret_cast<const uint8_t*>(held->data());
  s.size = held->size();
  s.keepalive = std::move(held);
  return s;
}

// A segment over one of the FastCodec constants (alive for the process).
OutSegment constantSegment(const std::string& bytes) {
  OutSegment s;
  s.data = reinterpret_cast<const uint8_t*>(bytes.data());
  s.size = bytes.size();
  return s;
}

// Encodes value as moolib.serialization.dumps would; its segments.
std::vector<OutSegment> encodeValue(py::handle value) {
  FastCodec& fc = fastCodec();
  std::vector<OutSegment> segs;
  if (value.is_none()) {
    segs.push_back(constantSegment(fc.noneValue));
  } else if (isPlain(value.ptr(), 3)) {
    py::object data = callOrThrow(fc.dumps, value, py::int_(5));
    char* p;
    Py_ssize_t n;
    PyBytes_AsStringAndSize(data.ptr(), &p, &n);
    segs.push_back(ownedSegment(std::string(p, size_t(n))));
  } else {
    py::tuple encoded = callOrThrow(codec().dumps, value);
    segs = exportSegments(encoded[0], encoded[1].cast<py::list>());
  }
  return segs;
}

bool segmentIs(const Buffer& b, const std::string& bytes) {
  return b.size() == bytes.size() && std::memcmp(b.data(), bytes.data(), bytes.size()) == 0;
}

py::object decodeSegments(const std::vector<BufferPtr>& segs) {
  if (segs.empty()) return py::none();
  if (segs.size() == 1 && segmentIs(*segs[0], fastCodec().noneValue)) return py::none();
  if (segs.size() == 1 && segs[0]->size() <= 65536) {
    // No out-of-band buffers: what codec().loads would do, without its frame.
    return callOrThrow(fastCodec().loads,
                       py::bytes(reinterpret_cast<const char*>(segs[0]->data()), segs[0]->size()));
  }
  // The pickle stream is usually small: a bytes copy is cheaper than a
  // buffer object (and pickle reads it either way).
  py::object stream;
  if (segs[0]->size() <= 65536) {
    stream = py::bytes(reinterpret_cast<const char*>(segs[0]->data()), segs[0]->size());
  } else {
    stream = py::cast(PyBuffer{segs[0]});
  }
  py::list buffers(segs.size() - 1);
  for (size_t i = 1; i < segs.size(); ++i) buffers[i - 1] = py::cast(PyBuffer{segs[i]});
  return callOrThrow(codec().loads, stream, buffers);
}

// What the caller sees of the Python exception e: moolib.rpc._describe of
// it (type, message, remote traceback), as the Python-level handlers send.
std::string describeError(py::error_already_set& e) {
  e.restore();
  PyObject *type, *value, *trace;
  PyErr_Fetch(&type, &value, &trace);
  PyErr_NormalizeException(&type, &value, &trace);
  if (value && trace) PyException_SetTraceback(value, trace);
  py::object exc = py::reinterpret_steal<py::object>(value);
  Py_XDECREF(type);
  Py_XDECREF(trace);
  try {
    return callOrThrow(fastCodec().describe, exc).cast<std::string>();
  } catch (py::error_already_set& inner) {
    return inner.what();
  }
}

// Runs a function defined with Rpc.define (a moolib.rpc._Plain) on a call's
// arguments and answers it, as moolib.rpc._serve does, without its Python
// frames and without a Python Responder and segment objects per call.
void servePlain(py::handle plain, Responder& responder, std::vector<BufferPtr>& args) {
  FastCodec& fc = fastCodec();
  std::vector<OutSegment> reply;
  py::object result;
  try {
    py::object fn = plain.attr("fn");
    py::object callArgs, callKwargs;
    if (args.size() == 1 && segmentIs(*args[0], fc.emptyCall)) {
      callArgs = py::tuple();
    } else {
      py::object decoded = decodeSegments(args);
      py::tuple pair = py::reinterpret_steal<py::tuple>(PySequence_Tuple(decoded.ptr()));
      if (!pair) throw py::error_already_set();
      if (pair.size() != 2) {
        PyErr_Format(PyExc_ValueError, "expected (args, kwargs), got %zd values",
                     Py_ssize_t(pair.size()));
        throw py::error_already_set();
      }
      callArgs = py::reinterpret_steal<py::object>(PySequence_Tuple(pair[0].ptr()));
      if (!callArgs) throw py::error_already_set();
      if (PyDict_CheckExact(pair[1].ptr())) {
        if (PyDict_GET_SIZE(pair[1].ptr()) != 0) callKwargs = pair[1];
      } else {
        callKwargs = py::dict();
        if (PyDict_Update(callKwargs.ptr(), pair[1].ptr()) != 0) throw py::error_already_set();
      }
    }
    // The reply goes out after the arguments are released, so shared-memory
    // segments are free for reuse by the time the caller's next call needs one.
    args.clear();
    result = py::reinterpret_steal<py::object>(
        callParkingOnExit(fn.ptr(), callArgs.ptr(), callKwargs ? callKwargs.ptr() : nullptr));
    if (!result) throw py::error_already_set();
    callArgs = py::object();
    callKwargs = py::object();
    reply = encodeValue(result);
  } catch (py::error_already_set& e) {
    responder.error(describeError(e));
    return;
  }
  responder.reply(std::move(reply));
}

// Calls handler(responder, segments) (GIL held). A handler may return
// (data, buffers) instead of replying itself: the reply then goes out after
// the arguments are released, so shared-memory segments are free for reuse
// by the time the caller's next call needs one.
void callHandler(py::handle handler, const std::shared_ptr<Responder>& responder,
                 std::vector<BufferPtr>& args) {
  try {
    py::object reply;
    {
      py::object r = py::cast(responder);
      py::list segments = wrapSegments(args);
      args.clear();
      reply = callFromCore(handler.ptr(), {r, segments});
    }
    if (!reply) throw py::error_already_set();
    if (!reply.is_none()) {
      auto tuple = reply.cast<py::tuple>();
      auto segs = exportSegments(tuple[0], tuple[1].cast<py::list>());
      responder->reply(std::move(segs));
    }
  } catch (py::error_already_set& e) {
    responder->error(e.what());
  } catch (const std::exception& e) {
    responder->error(e.what());
  }
}

// The core's handler of a function defined in Python: it finds the handler,
// owner._handlers[name], through a weak reference to the moolib.Rpc object
// that owns it, so that no strong reference to the handler hides in the core
// (a handler referring back to its Rpc's owner makes a cycle that the garbage
// collector sees whole).
Rpc::Handler pythonDispatcher(py::handle ownerRef, const std::string& name) {
  if (!PyWeakref_CheckRef(ownerRef.ptr())) throw py::type_error("expected a weak reference");
  auto ref = holdObject(ownerRef);
  auto key = holdObject(py::str(name));
  return [ref, key, name](std::shared_ptr<Responder> responder, std::vector<BufferPtr> args) {
    withPython([&] {
      try {
        py::object handler;
        {
          py::handle owner = PyWeakref_GetObject(ref.get());  // borrowed; None once dead
          if (!owner.is_none()) {
            py::object handlers = owner.attr(fastCodec().handlersName);
            PyObject* h = PyDict_GetItemWithError(handlers.ptr(), key.get());
            if (!h && PyErr_Occurred()) throw py::error_already_set();
            handler = py::reinterpret_borrow<py::object>(h);
          }
        }  // a call in progress does not keep the Rpc alive
        if (!handler) {
          responder->error(concat("function '", name, "' is gone: its Rpc was deleted"));
          return;
        }
        if (Py_TYPE(handler.ptr()) ==
            reinterpret_cast<PyTypeObject*>(fastCodec().plainType.ptr())) {
          servePlain(handler, *responder, args);
        } else {
          callHandler(handler, responder, args);
        }
      } catch (py::error_already_set& e) {
        responder->error(e.what());
      }
    });
  };
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
    return decodeSegments(state->result()).release().ptr();
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
    {"done", futureDone, METH_NOARGS, "Whether the call has completed."},
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
     "Gives up on the call; returns False if it had already completed."},
    {"cancelled", futureCancelled, METH_NOARGS, "Whether the call was cancelled."},
    {"_segments", futureSegments, METH_NOARGS, "The raw segments of a successful result."},
    {"add_done_callback", futureAddDoneCallback, METH_O,
     "Calls fn(future) on a core thread once the call completes."},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef futureMembers[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(FutureObject, weakrefs), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

void initFutureType(py::module_& m) {
  static PyType_Slot slots[] = {
      {Py_tp_dealloc, reinterpret_cast<void*>(futureDealloc)},
      {Py_tp_methods, futureMethods},
      {Py_tp_members, futureMembers},
      {Py_tp_doc, const_cast<char*>("The result of an asynchronous call, completed by the core.")},
      {0, nullptr}};
  static PyType_Spec spec = {"moolib._core.Future", int(sizeof(FutureObject)), 0,
                             Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, slots};
  PyObject* type = PyType_FromSpec(&spec);
  if (!type) throw py::error_already_set();
  gFutureType = reinterpret_cast<PyTypeObject*>(type);
  m.add_object("Future", py::reinterpret_borrow<py::object>(type));  // the module keeps it
}

}  // namespace

namespace moolib::binding {

PyObject* wrapFuture(FuturePtr state) {
  auto* f = PyObject_New(FutureObject, gFutureType);
  if (!f) return nullptr;
  f->weakrefs = nullptr;
  new (f->storage) FuturePtr(std::move(state));
  return reinterpret_cast<PyObject*>(f);
}

}  // namespace moolib::binding

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
  PyRpc& rpc = py::cast<PyRpc&>(py::handle(self));
  std::vector<OutSegment> segs;
  Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  if (nargs == 2 && nkw == 0) {
    segs.push_back(constantSegment(fastCodec().emptyCall));
  } else {
    py::tuple callArgs(nargs - 2);
    for (Py_ssize_t i = 2; i != nargs; ++i) {
      PyTuple_SET_ITEM(callArgs.ptr(), i - 2, py::handle(args[i]).inc_ref().ptr());
    }
    py::dict callKwargs;
    for (Py_ssize_t i = 0; i != nkw; ++i) {
      if (PyDict_SetItem(callKwargs.ptr(), PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) != 0) {
        throw py::error_already_set();
      }
    }
    segs = encodeValue(py::make_tuple(callArgs, callKwargs));
  }
  // The GIL stays held: a call never blocks (sockets are non-blocking) and no
  // core lock is ever held while waiting for the GIL (the core releases no
  // Python object itself: DeferredReleases), so this cannot deadlock, and it
  // saves a GIL hand-off per call.
  FuturePtr state =
      rpc.rpc->call(std::string(peer, size_t(peerSize)),
                    std::string(function, size_t(functionSize)), std::move(segs), waitNext);
  // What the send finished with (this call's arguments, when written at once)
  // is released before the caller goes on, as if the core held no reference.
  DeferredReleases::instance().drain();
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
    return decodeSegments(state->result()).release().ptr();
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

// What the Python Rpc objects of one core Rpc, and the Groups and Brokers
// made on them, share. Core threads hold the Rpc itself, for as long as a
// function runs or a timer fires; when the last Python-side share goes
// (the object deleted or garbage collected without close()), the Owner closes
// the Rpc right there, so that its addresses are free and its peers see it
// gone by the time `del` or gc.collect() returns.
PyRpc createRpc() {
  struct Owner {
    std::shared_ptr<Rpc> rpc;
    explicit Owner(std::shared_ptr<Rpc> r) : rpc(std::move(r)) {}
    Owner(const Owner&) = delete;
    Owner& operator=(const Owner&) = delete;
    ~Owner() {
      // close() waits for no core thread and never for the GIL: it is safe
      // wherever the last share drops, on a core thread too.
      if (rpc->inherited()) return;
      try {
        rpc->close();
      } catch (const std::exception& e) {
        MOO_LOG(kError, "closing a dropped Rpc: ", e.what());
      }
    }
  };
  auto owner = std::make_shared<Owner>(Rpc::create());
  Rpc* rpc = owner->rpc.get();
  return PyRpc{std::shared_ptr<Rpc>(std::move(owner), rpc)};
}

// A member function of Rpc as a method of PyRpc.
template <typename R, typename... A>
auto onRpc(R (Rpc::*method)(A...)) {
  return [method](PyRpc& self, A... args) -> R {
    return ((*self.rpc).*method)(std::forward<A>(args)...);
  };
}
template <typename R, typename... A>
auto onRpc(R (Rpc::*method)(A...) const) {
  return [method](PyRpc& self, A... args) -> R {
    return ((*self.rpc).*method)(std::forward<A>(args)...);
  };
}

// Forwards core log lines to a Python callable from a thread of its own, so
// that no core thread ever waits for the GIL while holding a lock.
class PythonLogSink {
 public:
  static PythonLogSink& instance() {
    static auto* s = new PythonLogSink();  // leaked: its thread runs until exit
    return *s;
  }
  void set(py::object fn) {
    bool enabled;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = fn.is_none() ? nullptr : holdObject(fn);
      enabled = bool(fn_);
      if (enabled && !started_) {
        started_ = true;
        std::thread([this] { run(); }).detach();
      }
    }
    // Outside mutex_: a core thread logging holds the sink registry's lock
    // while it calls push(), which takes mutex_ (lock order sink -> mutex_).
    if (enabled) {
      setLogSink([this](LogLevel level, const std::string& message) { push(level, message); });
    } else {
      setLogSink(nullptr);
    }
  }

 private:
  void push(LogLevel level, const std::string& message) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (queue_.size() > 10000) return;
      queue_.emplace_back(level, message);
    }
    cv_.notify_one();
  }
  void run() {
    while (true) {
      std::pair<LogLevel, std::string> item;
      std::shared_ptr<PyObject> fn;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return !queue_.empty(); });
        item = std::move(queue_.front());
        queue_.pop_front();
        fn = fn_;
      }
      if (!fn || !Py_IsInitialized()) continue;
      withPython([&] {
        py::object level = py::int_(int(item.first));
        py::object message = py::str(item.second);
        if (!callFromCore(fn.get(), {level, message})) PyErr_WriteUnraisable(fn.get());
      });
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<LogLevel, std::string>> queue_;
  std::shared_ptr<PyObject> fn_;
  bool started_ = false;
};

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "moolib core: transports, framing and RPC (C++17). Use the moolib package instead.";
  initFastCodec();

  py::class_<PyBuffer>(m, "Buffer", py::buffer_protocol())
      .def_buffer([](PyBuffer& b) {
        return py::buffer_info(b.buffer->data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {py::ssize_t(b.buffer->size())}, {py::ssize_t(1)}, false);
      })
      .def("__len__", [](const PyBuffer& b) { return b.buffer->size(); });

  bindErrors(m);
  initFutureType(m);

  py::class_<Responder, std::shared_ptr<Responder>>(m, "Responder")
      .def("reply",
           [](Responder& r, py::handle data, py::list buffers) {
             auto segs = exportSegments(data, buffers);
             GilRelease nogil;
             r.reply(std::move(segs));
           })
      .def("error",
           [](Responder& r, const std::string& message) {
             GilRelease nogil;
             r.error(message);
           })
      .def_property_readonly("peer", &Responder::peer)
      .def_property_readonly("function", &Responder::function);

  py::class_<PyRpc> rpcClass(m, "Rpc", "The C++ peer; moolib.Rpc adds the Python-level API.");
  addFastMethod(rpcClass, &rpcAsyncDef);
  addFastMethod(rpcClass, &rpcSyncDef);
  rpcClass.def(py::init(&createRpc))
      .def("set_name", onRpc(&Rpc::setName))
      .def("get_name", onRpc(&Rpc::name))
      .def("listen", onRpc(&Rpc::listen), py::call_guard<GilRelease>())
      .def("connect", onRpc(&Rpc::connect), py::call_guard<GilRelease>())
      .def("set_timeout", onRpc(&Rpc::setTimeout))
      .def("get_timeout", onRpc(&Rpc::timeout))
      .def("set_transports", onRpc(&Rpc::setTransports))
      .def("set_auth_key", onRpc(&Rpc::setAuthKey))
      .def(
          "_define_owned",
          [](PyRpc& self, const std::string& name, py::handle ownerRef) {
            self.rpc->define(name, pythonDispatcher(ownerRef, name));
          },
          "Defines name as owner._handlers[name] of the moolib.Rpc that ownerRef (a weak "
          "reference) names.")
      .def("define",
           [](PyRpc& self, const std::string& name, py::function fn) {
             auto held = holdObject(fn);
             self.rpc->define(
                 name, [held](std::shared_ptr<Responder> responder, std::vector<BufferPtr> args) {
                   withPython([&] { callHandler(held.get(), responder, args); });
                 });
           })
      .def("undefine", onRpc(&Rpc::undefine), py::call_guard<GilRelease>())
      .def("close", onRpc(&Rpc::close), py::call_guard<GilRelease>())
      .def("debug_info", [](PyRpc& self) {
        DebugInfo info;
        {
          GilRelease nogil;
          info = self.rpc->debugInfo();
        }
        return toPython(info);
      });

  m.def("set_log_level", [](int level) { setLogLevel(LogLevel(std::max(0, std::min(level, 4)))); });
  m.def("get_log_level", [] { return int(logLevel()); });
  m.def("set_log_sink", [](py::object fn) { PythonLogSink::instance().set(fn); });
  m.def("set_max_threads", [](int n) { Loop::instance().setMaxThreads(n); });
  m.def("get_max_threads", [] { return Loop::instance().maxThreads(); });
  // Diagnostics of the spin before blocking waits (spin.h), for this process.
  m.def("_spin_stats", [] {
    SpinStats s = SpinPolicy::stats();
    py::dict d;
    d["budget_us"] =
        std::chrono::duration_cast<std::chrono::microseconds>(SpinPolicy::budget()).count();
    // The calling thread's budget now (SpinPolicy::threadBudget).
    d["thread_budget_us"] =
        std::chrono::duration_cast<std::chrono::microseconds>(SpinPolicy::current().threadBudget())
            .count();
    d["waits"] = s.waits;
    d["spins"] = s.spins;
    d["hits"] = s.hits;
    return d;
  });
  m.def("create_uid", [] { return randomHex(16); });
  m.def("host_identity", &hostIdentity);
  // Tests of the UCX transport's checks: bytes sent as they are.
  m.def(
      "_ucx_send_raw",
      [](const std::string& address, const py::bytes& data, double timeout) {
        std::string bytes = data;
        py::gil_scoped_release release;
        return ucxSendRaw(address, bytes, timeout);
      },
      "address"_a, "data"_a, "timeout"_a = 10.0);
  m.def(
      "shutdown",
      [](double graceSeconds) {
        gExiting = true;
        GilRelease nogil;
        Loop::instance().shutdown(std::chrono::milliseconds(int64_t(graceSeconds * 1000)));
      },
      py::arg("grace") = 2.0);
  bindGroup(m);
  bindReplay(m);
  bindShm(m);
  m.def("drain_releases", [] { DeferredReleases::instance().drain(); });
  m.def(
      "_is_plain", [](py::handle obj, int depth) { return isPlain(obj.ptr(), depth); },
      py::arg("obj"), py::arg("depth"),
      "The C verdict of moolib.serialization._is_plain, exposed so tests can hold the two "
      "together.");
  m.def(
      "set_dispatch",
      [](py::object plainType, py::object describe) {
        fastCodec().plainType = std::move(plainType);
        fastCodec().describe = std::move(describe);
      },
      "Registers the type of plain function handlers (its fn attribute is called with the "
      "call's arguments) and describe(exception) -> str, the error text of a failed call.");
  m.def(
      "set_codec",
      [](py::object dumps, py::object loads) {
        codec().dumps = std::move(dumps);
        codec().loads = std::move(loads);
      },
      "Registers dumps(obj) -> (bytes, [buffers]) and loads(data, buffers) for calls made from "
      "C++.");
}
