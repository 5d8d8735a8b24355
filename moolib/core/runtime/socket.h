// Small POSIX socket helpers shared by the stream transports.
#pragma once

#include <sys/socket.h>

#include <string>
#include <utility>
#include <vector>

namespace moolib {

// Owns a file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    reset(std::exchange(o.fd_, -1));
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1);
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

struct SockAddr {
  sockaddr_storage storage{};
  socklen_t length = 0;
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
  sockaddr* get() { return reinterpret_cast<sockaddr*>(&storage); }
  int family() const { return storage.ss_family; }
};

// "host:port", "[v6addr]:port" or ":port" (all interfaces). Host names are
// resolved. Throws moolib::Exception with the reason.
SockAddr parseTcpAddress(const std::string& address);
// Every address a TCP address resolves to, in getaddrinfo's order (on most
// hosts "localhost" is ::1, then 127.0.0.1), without repeats; at least one.
std::vector<SockAddr> resolveTcpAddress(const std::string& address);
// Checks the form of a TCP address (as parseTcpAddress takes it) without
// resolving it; throws moolib::Exception with the reason.
void checkTcpAddress(const std::string& address);
// "host:port" with brackets for IPv6.
std::string formatTcpAddress(const SockAddr& addr);
// An abstract-namespace Unix socket address for a shared-memory endpoint name.
SockAddr unixAbstractAddress(const std::string& name);

bool isLoopbackAddress(const SockAddr& addr);
bool isWildcardAddress(const SockAddr& addr);
// "host:port" parsed without resolving; false if it is not an IP literal.
bool isLoopbackHostPort(const std::string& address);

void setNonBlocking(int fd);
std::string errnoString(int err);

}  // namespace moolib
