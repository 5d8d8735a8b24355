// The Python binding, moolib._core: marshalling only. The public API is
// moolib/*.py; each file of moolib/core/python binds one part.
#include "python/module.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>

#include "python/codec.h"
#include "python/dispatch.h"
#include "python/errors.h"
#include "python/future_type.h"
#include "python/gil.h"
#include "python/segments.h"
#include "runtime/host.h"
#include "runtime/loop.h"
#include "runtime/spin.h"
#include "transport/ucx/ucx_api.h"

namespace py = pybind11;
using namespace pybind11::literals;
using namespace moolib;
using namespace moolib::binding;

PyTypeObject* moolib::binding::addType(py::module_& m, PyType_Spec& spec, const char* name) {
  PyObject* type = PyType_FromSpec(&spec);
  if (!type) throw py::error_already_set();
  m.add_object(name, py::reinterpret_borrow<py::object>(type));  // the module keeps it
  return reinterpret_cast<PyTypeObject*>(type);
}

PYBIND11_MODULE(_core, m) {
  m.doc() = "moolib core: transports, framing and RPC (C++17). Use the moolib package instead.";
  initCodec();
  bindBuffer(m);
  bindErrors(m);
  bindFuture(m);
  bindHandler(m);
  bindRpc(m);
  bindLogging(m);
  m.def(
      "set_max_threads", [](int n) { Loop::instance().setMaxThreads(n); }, py::arg("n"),
      "Pool threads that run I/O and called functions (MOOLIB_MAX_THREADS).");
  m.def("get_max_threads", [] { return Loop::instance().maxThreads(); });
  // Diagnostics of the spin before blocking waits (runtime/spin.h), for this process.
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
  m.def("drain_releases", [] { drainReleases(); });
  bindCodec(m);
}
