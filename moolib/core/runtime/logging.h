// Leveled logging. Messages go to stderr unless a sink is installed (the
// binding installs one that forwards to Python's logging when asked).
#pragma once

#include <functional>
#include <string>

#include "runtime/error.h"

namespace moolib {

enum class LogLevel : int { kNone = 0, kError = 1, kInfo = 2, kVerbose = 3, kDebug = 4 };

void setLogLevel(LogLevel level);
LogLevel logLevel();
// The sink may be called from any core thread; it must not block on the GIL.
void setLogSink(std::function<void(LogLevel, const std::string&)> sink);
void emitLog(LogLevel level, const std::string& message);

inline bool logEnabled(LogLevel level) {
  return static_cast<int>(level) <= static_cast<int>(logLevel());
}

}  // namespace moolib

#define MOO_LOG(level, ...)                                                        \
  do {                                                                             \
    if (::moolib::logEnabled(::moolib::LogLevel::level))                           \
      ::moolib::emitLog(::moolib::LogLevel::level, ::moolib::concat(__VA_ARGS__)); \
  } while (0)
