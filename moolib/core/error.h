// Error policy of the core.
//
// - Misuse of the synchronous API and invalid arguments throw moolib::Exception
//   through MOO_ENFORCE; the binding turns it into a Python RuntimeError.
// - Asynchronous failures (a connection that dies, a call that times out, a
//   remote exception) travel as Error values: a message, empty when all is
//   well, that reads as a boolean.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace moolib {

class Exception : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream ss;
  (ss << ... << std::forward<Args>(args));
  return ss.str();
}

class Error {
 public:
  Error() = default;
  explicit Error(std::string message) : message_(std::move(message)) {}
  explicit operator bool() const { return !message_.empty(); }
  const std::string& what() const { return message_; }

 private:
  std::string message_;
};

}  // namespace moolib

#define MOO_ENFORCE(cond, ...)                                             \
  do {                                                                     \
    if (!(cond)) throw ::moolib::Exception(::moolib::concat(__VA_ARGS__)); \
  } while (0)
