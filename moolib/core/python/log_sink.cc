// The core's log lines, handed to Python's logging.
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "python/gil.h"
#include "python/module.h"
#include "runtime/logging.h"

namespace moolib::binding {

namespace {

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

void bindLogging(py::module_& m) {
  m.def(
      "set_log_level", [](int level) { setLogLevel(LogLevel(std::max(0, std::min(level, 4)))); },
      py::arg("level"));
  m.def("get_log_level", [] { return int(logLevel()); });
  m.def(
      "set_log_sink", [](py::object fn) { PythonLogSink::instance().set(fn); }, py::arg("fn"));
}

}  // namespace moolib::binding
