// Error policy of the core.
//
// - Misuse of the synchronous API and invalid arguments throw moolib::Exception
//   through MOO_ENFORCE; the binding turns it into a Python RuntimeError.
// - Asynchronous failures (a connection that dies, a call that times out, a
//   remote exception) travel as Error values: a code saying what kind of
//   failure it is, which callers decide on, and a message for people, which
//   nothing decides on. An Error reads as a boolean: true when it is one.
//   The binding raises the moolib.errors class of the code (moolib/errors.py).
#pragma once

#include <cstdint>
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

// What kind of failure an Error is. The value is the status byte of a
// kResponse frame and the code of a collective's abort message (rpc/wire.h,
// collectives/collective.h): kRemoteException and kNotDefined keep the
// values that byte had before the other codes existed, and a value a peer
// does not know reads as kFailed (fromWire). Append new codes before kCount;
// never renumber.
enum class ErrorCode : uint8_t {
  kOk = 0,
  // The function ran on the callee and raised (or answered with an error).
  kRemoteException = 1,
  // The callee has no function of that name.
  kNotDefined = 2,
  // No reply within the call's timeout (the peer slow, stuck, not found or
  // not linked), or a collective not complete within its timeout.
  kTimeout = 3,
  // The links to the peer closed before the reply came (its process exited,
  // it closed its Rpc, the network dropped), or this Rpc was closed.
  kConnectionLost = 4,
  // Given up on by cancel().
  kCancelled = 5,
  // A collective could not create or map the shared memory it needed.
  kSharedMemoryUnavailable = 6,
  // A collective's group changed membership, or this peer was not, or no
  // longer, a member while it ran.
  kMembershipChanged = 7,
  // The only links that reached for the peer failed their handshake's
  // authentication (keys differ, or only one side has one).
  kAuthenticationFailed = 8,
  // Any other failure (a malformed message, a mismatch between members).
  kFailed = 9,
  kCount
};

// The code's name, by which moolib/errors.py registers its class.
inline const char* errorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return "ok";
    case ErrorCode::kRemoteException:
      return "remote_exception";
    case ErrorCode::kNotDefined:
      return "not_defined";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kConnectionLost:
      return "connection_lost";
    case ErrorCode::kCancelled:
      return "cancelled";
    case ErrorCode::kSharedMemoryUnavailable:
      return "shared_memory_unavailable";
    case ErrorCode::kMembershipChanged:
      return "membership_changed";
    case ErrorCode::kAuthenticationFailed:
      return "authentication_failed";
    case ErrorCode::kFailed:
    case ErrorCode::kCount:
      break;
  }
  return "failed";
}

// The code a peer sent; one this build does not know is kFailed.
inline ErrorCode errorCodeFromWire(uint8_t v) {
  return v < uint8_t(ErrorCode::kCount) ? ErrorCode(v) : ErrorCode::kFailed;
}

class Error {
 public:
  Error() = default;
  // A plain failure (kFailed), or no error if message is empty.
  explicit Error(std::string message)
      : code_(message.empty() ? ErrorCode::kOk : ErrorCode::kFailed),
        message_(std::move(message)) {}
  // A failure of the given kind; an empty message gets a generic one.
  Error(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {
    if (code_ != ErrorCode::kOk && message_.empty()) message_ = "unknown error";
  }
  explicit operator bool() const { return code_ != ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& what() const { return message_; }

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

}  // namespace moolib

#define MOO_ENFORCE(cond, ...)                                             \
  do {                                                                     \
    if (!(cond)) throw ::moolib::Exception(::moolib::concat(__VA_ARGS__)); \
  } while (0)
