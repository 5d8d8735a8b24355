// The Python binding: marshalling only. The public API is moolib/rpc.py.
#include "bindings.h"

#include <cxxabi.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <condition_variable>
#include <deque>
#include <thread>

#include "host.h"
#include "logging.h"
#include "rpc.h"

namespace py = pybind11;
using namespace pybind11::literals;
using namespace moolib;
using namespace moolib::binding;

namespace {

// Python objects referenced from core threads. The core may drop its last
// reference on a thread without the GIL; such releases wait in a queue that is
// drained by the next thread that holds the GIL.
class DeferredReleases {
 public:
  void add(Py_buffer* view, PyObject* object) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      items_.push_back({view, object});
      if (scheduled_) return;
      scheduled_ = true;
    }
    Py_AddPendingCall(
        [](void*) {
          instance().drain();
          return 0;
        },
        nullptr);
  }
  void drain() {
    std::vector<std::pair<Py_buffer*, PyObject*>> items;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      items.swap(items_);
      scheduled_ = false;
    }
    for (auto& [view, object] : items) release(view, object);
  }
  static void release(Py_buffer* view, PyObject* object) {
    if (view) {
      PyBuffer_Release(view);
      std::unique_ptr<Py_buffer> owned(view);
    }
    Py_XDECREF(object);
  }
  static DeferredReleases& instance() {
    static auto* d = new DeferredReleases();  // leaked: used until the process ends
    return *d;
  }

 private:
  std::mutex mutex_;
  std::vector<std::pair<Py_buffer*, PyObject*>> items_;
  bool scheduled_ = false;
};

void releaseFromAnyThread(Py_buffer* view, PyObject* object) {
  if (Py_IsInitialized() == 0) return;
  if (PyGILState_Check()) {
    DeferredReleases::release(view, object);
  } else {
    DeferredReleases::instance().add(view, object);
  }
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

// Runs body with the GIL on a core thread (or not at all once exiting).
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

double toDeadlineSeconds(const py::object& timeout) {
  return timeout.is_none() ? -1.0 : timeout.cast<double>();
}

TimePoint deadlineFrom(double seconds) {
  if (seconds < 0) return kForever;
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

bool futureWait(const PyFuture& f, py::object timeout) {
  TimePoint deadline = deadlineFrom(toDeadlineSeconds(timeout));
  // Waits in slices so that Ctrl-C (a KeyboardInterrupt) gets through.
  while (true) {
    TimePoint slice = std::min(deadline, Clock::now() + std::chrono::milliseconds(100));
    bool done;
    {
      GilRelease nogil;
      done = f.state->wait(slice);
    }
    if (done) return true;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (Clock::now() >= deadline) return false;
  }
}

struct RpcErrorTag {};

// debug_info() as plain dicts and lists.
py::dict toPython(const ConnectionInfo& c) {
  return py::dict("transport"_a = c.transport, "local"_a = c.local, "remote"_a = c.remote,
                  "outgoing"_a = c.outgoing, "bytes_sent"_a = c.bytesSent,
                  "bytes_received"_a = c.bytesReceived);
}

py::dict toPython(const PeerInfo& p) {
  py::list connections;
  for (auto& c : p.connections) connections.append(toPython(c));
  return py::dict("name"_a = p.name, "same_host"_a = p.sameHost, "addresses"_a = p.addresses,
                  "queued_calls"_a = p.queuedCalls, "connections"_a = connections);
}

py::dict toPython(const DebugInfo& info) {
  py::list peers;
  for (auto& p : info.peers) peers.append(toPython(p));
  return py::dict("name"_a = info.name, "listening"_a = info.listening,
                  "advertised"_a = info.advertised, "transports"_a = info.transports,
                  "pending_calls"_a = info.pendingCalls,
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

py::object decodeSegments(const std::vector<BufferPtr>& segs) {
  if (segs.empty()) return py::none();
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
  return codec().loads(stream, buffers);
}

PyFuture callWithArgs(PyRpc& self, const std::string& peer, const std::string& function,
                      py::args args, py::kwargs kwargs) {
  py::tuple encoded = codec().dumps(py::make_tuple(args, kwargs));
  // The GIL stays held: a call never blocks (sockets are non-blocking) and no
  // core lock is ever held while waiting for the GIL, so this cannot
  // deadlock, and it saves a GIL hand-off per call.
  auto segs = exportSegments(encoded[0], encoded[1].cast<py::list>());
  return PyFuture{self.rpc->call(peer, function, std::move(segs))};
}

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

  py::class_<PyBuffer>(m, "Buffer", py::buffer_protocol())
      .def_buffer([](PyBuffer& b) {
        return py::buffer_info(b.buffer->data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {py::ssize_t(b.buffer->size())}, {py::ssize_t(1)}, false);
      })
      .def("__len__", [](const PyBuffer& b) { return b.buffer->size(); });

  // Leaked: destroying it at exit would run after the interpreter is gone.
  static auto& rpcError = *new py::exception<RpcErrorTag>(m, "RpcError", PyExc_RuntimeError);
  rpcError.doc() =
      "A call failed: timeout, unknown peer or function, or an exception in the remote function.";

  py::class_<PyFuture>(m, "Future", "The result of an asynchronous call, completed by the core.")
      .def(
          "done", [](const PyFuture& f) { return f.state->done(); },
          "Whether the call has completed.")
      .def("wait", &futureWait, py::arg("timeout") = py::none(),
           "Waits until the call completes; returns whether it did within timeout.")
      .def(
          "result",
          [](const PyFuture& f, py::object timeout) {
            if (!f.state->done() && !futureWait(f, timeout)) {
              PyErr_SetString(PyExc_TimeoutError,
                              "the call did not complete within the wait timeout");
              throw py::error_already_set();
            }
            if (!f.state->error().empty()) {
              PyErr_SetString(rpcError.ptr(), f.state->error().c_str());
              throw py::error_already_set();
            }
            return decodeSegments(f.state->result());
          },
          py::arg("timeout") = py::none(),
          "Waits for the call and returns its result; raises RpcError if it failed, TimeoutError "
          "if timeout "
          "seconds pass first (the call goes on).")
      .def(
          "exception",
          [](const PyFuture& f, py::object timeout) -> py::object {
            if (!f.state->done() && !futureWait(f, timeout)) {
              PyErr_SetString(PyExc_TimeoutError,
                              "the call did not complete within the wait timeout");
              throw py::error_already_set();
            }
            if (f.state->error().empty()) return py::none();
            return py::handle(rpcError.ptr())(f.state->error());
          },
          py::arg("timeout") = py::none(),
          "Waits for the call; returns its error as an RpcError, or None.")
      .def(
          "cancel", [](const PyFuture& f) { return f.state->cancel(); },
          "Gives up on the call; returns False if it had already completed.")
      .def("cancelled", [](const PyFuture& f) { return f.state->cancelled(); })
      .def(
          "_segments",
          [](const PyFuture& f) {
            MOO_ENFORCE(f.state->done() && f.state->error().empty(), "the call has not succeeded");
            return wrapSegments(f.state->result());
          },
          "The raw segments of a successful result.")
      .def(
          "add_done_callback",
          [](py::object self, py::function fn) {
            auto held = holdObject(fn);
            auto me = holdObject(self);
            self.cast<PyFuture&>().state->onDone([held, me] {
              withPython([&] {
                if (!callFromCore(held.get(), {py::handle(me.get())}))
                  PyErr_WriteUnraisable(held.get());
              });
            });
          },
          "Calls fn(future) on a core thread once the call completes.");

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

  py::class_<PyRpc>(m, "Rpc", "The C++ peer; moolib.Rpc adds the Python-level API.")
      .def(py::init(&createRpc))
      .def("set_name", onRpc(&Rpc::setName))
      .def("get_name", onRpc(&Rpc::name))
      .def("listen", onRpc(&Rpc::listen), py::call_guard<GilRelease>())
      .def("connect", onRpc(&Rpc::connect), py::call_guard<GilRelease>())
      .def("set_timeout", onRpc(&Rpc::setTimeout))
      .def("get_timeout", onRpc(&Rpc::timeout))
      .def("set_transports", onRpc(&Rpc::setTransports))
      .def("set_auth_key", onRpc(&Rpc::setAuthKey))
      .def("define",
           [](PyRpc& self, const std::string& name, py::function fn) {
             auto held = holdObject(fn);
             self.rpc->define(
                 name, [held](std::shared_ptr<Responder> responder, std::vector<BufferPtr> args) {
                   withPython([&] {
                     DeferredReleases::instance().drain();
                     try {
                       py::object reply;
                       {
                         py::object r = py::cast(responder);
                         py::list segments = wrapSegments(args);
                         args.clear();
                         reply = callFromCore(held.get(), {r, segments});
                       }
                       if (!reply) throw py::error_already_set();
                       // A handler may return (data, buffers) instead of replying
                       // itself: the reply then goes out after the arguments are
                       // released, so shared-memory segments are free for reuse
                       // by the time the caller's next call needs one.
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
                   });
                 });
           })
      .def("undefine", onRpc(&Rpc::undefine), py::call_guard<GilRelease>())
      .def("async_", &callWithArgs, "Calls fn on peer; returns a Future for the result.")
      .def(
          "sync",
          [](PyRpc& self, const std::string& peer, const std::string& function, py::args args,
             py::kwargs kwargs) {
            PyFuture f = callWithArgs(self, peer, function, std::move(args), std::move(kwargs));
            futureWait(f, py::none());
            if (!f.state->error().empty()) {
              PyErr_SetString(rpcError.ptr(), f.state->error().c_str());
              throw py::error_already_set();
            }
            return decodeSegments(f.state->result());
          },
          "Calls fn on peer and waits for the result (raises RpcError on failure).")
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
  m.def("create_uid", [] { return randomHex(16); });
  m.def("host_identity", &hostIdentity);
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
  m.def("drain_releases", [] { DeferredReleases::instance().drain(); });
  m.def(
      "set_codec",
      [](py::object dumps, py::object loads) {
        codec().dumps = std::move(dumps);
        codec().loads = std::move(loads);
      },
      "Registers dumps(obj) -> (bytes, [buffers]) and loads(data, buffers) for calls made from "
      "C++.");
}
