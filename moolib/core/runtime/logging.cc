#include "runtime/logging.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <memory>
#include <mutex>

namespace moolib {

namespace {
std::atomic<int> gLevel{static_cast<int>(LogLevel::kError)};
std::mutex gSinkMutex;
// Leaked on purpose: logging may happen from threads that outlive static destruction.
auto* gSink = new std::function<void(LogLevel, const std::string&)>();

const char* levelName(LogLevel level) {
  switch (level) {
    case LogLevel::kError:
      return "error";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kVerbose:
      return "verbose";
    case LogLevel::kDebug:
      return "debug";
    default:
      return "none";
  }
}
}  // namespace

void setLogLevel(LogLevel level) { gLevel = static_cast<int>(level); }
LogLevel logLevel() { return static_cast<LogLevel>(gLevel.load(std::memory_order_relaxed)); }

void setLogSink(std::function<void(LogLevel, const std::string&)> sink) {
  std::lock_guard<std::mutex> lock(gSinkMutex);
  *gSink = std::move(sink);
}

void emitLog(LogLevel level, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(gSinkMutex);
    if (*gSink) {
      (*gSink)(level, message);
      return;
    }
  }
  std::time_t t = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof(when), "%H:%M:%S", std::localtime(&t));
  std::fprintf(stderr, "[moolib %s %s] %s\n", when, levelName(level), message.c_str());
}

}  // namespace moolib
