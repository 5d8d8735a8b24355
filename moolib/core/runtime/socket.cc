#include "runtime/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "runtime/error.h"

namespace moolib {

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string errnoString(int err) { return std::strerror(err); }

namespace {

std::pair<std::string, std::string> splitHostPort(const std::string& address) {
  std::string host, port;
  auto scheme = address.find("://");
  MOO_ENFORCE(scheme == std::string::npos, "bad address '", address, "': unknown scheme '",
              address.substr(0, scheme), "://' (give host:port for TCP, or a shm:// address)");
  if (!address.empty() && address[0] == '[') {
    auto close = address.find(']');
    MOO_ENFORCE(
        close != std::string::npos && close + 1 < address.size() && address[close + 1] == ':',
        "bad address '", address, "': expected [ipv6]:port");
    host = address.substr(1, close - 1);
    port = address.substr(close + 2);
  } else {
    auto colon = address.rfind(':');
    MOO_ENFORCE(colon != std::string::npos, "bad address '", address, "': expected host:port");
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
    MOO_ENFORCE(host.find(':') == std::string::npos, "bad address '", address,
                "': write IPv6 addresses as [addr]:port");
  }
  MOO_ENFORCE(!port.empty() && port.find_first_not_of("0123456789") == std::string::npos &&
                  port.size() <= 5 && std::stoi(port) <= 65535,
              "bad port in address '", address, "'");
  return {host, port};
}

}  // namespace

void checkTcpAddress(const std::string& address) { splitHostPort(address); }

std::vector<SockAddr> resolveTcpAddress(const std::string& address) {
  auto [host, port] = splitHostPort(address);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (host.empty() ? AI_PASSIVE : 0);
  hints.ai_family = AF_UNSPEC;
  addrinfo* result = nullptr;
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &result);
  MOO_ENFORCE(rc == 0 && result, "cannot resolve address '", address, "': ", gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owned(result, &freeaddrinfo);
  std::vector<SockAddr> out;
  for (addrinfo* a = result; a; a = a->ai_next) {
    if (a->ai_addrlen > sizeof(sockaddr_storage)) continue;
    SockAddr addr;
    std::memcpy(&addr.storage, a->ai_addr, a->ai_addrlen);
    addr.length = a->ai_addrlen;
    // A name listed twice in /etc/hosts comes back twice.
    bool seen = std::any_of(out.begin(), out.end(), [&](const SockAddr& o) {
      return o.length == addr.length && std::memcmp(&o.storage, &addr.storage, o.length) == 0;
    });
    if (!seen) out.push_back(addr);
  }
  MOO_ENFORCE(!out.empty(), "cannot resolve address '", address, "': no usable address");
  return out;
}

SockAddr parseTcpAddress(const std::string& address) { return resolveTcpAddress(address)[0]; }

std::string formatTcpAddress(const SockAddr& addr) {
  char host[INET6_ADDRSTRLEN] = {0};
  if (addr.family() == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(addr.get());
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    return concat(host, ":", ntohs(a->sin_port));
  }
  if (addr.family() == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(addr.get());
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    return concat("[", host, "]:", ntohs(a->sin6_port));
  }
  return "?";
}

SockAddr unixAbstractAddress(const std::string& name) {
  SockAddr out;
  auto* a = reinterpret_cast<sockaddr_un*>(out.get());
  a->sun_family = AF_UNIX;
  std::string path = "moolib/" + name;
  MOO_ENFORCE(path.size() + 1 < sizeof(a->sun_path),
              "shared-memory endpoint name too long: ", name);
  a->sun_path[0] = '\0';
  std::memcpy(a->sun_path + 1, path.data(), path.size());
  out.length = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + path.size());
  return out;
}

bool isLoopbackAddress(const SockAddr& addr) {
  if (addr.family() == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(addr.get());
    return (ntohl(a->sin_addr.s_addr) >> 24) == 127;
  }
  if (addr.family() == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(addr.get());
    if (IN6_IS_ADDR_LOOPBACK(&a->sin6_addr)) return true;
    if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) return a->sin6_addr.s6_addr[12] == 127;
  }
  return false;
}

bool isWildcardAddress(const SockAddr& addr) {
  if (addr.family() == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(addr.get())->sin_addr.s_addr == htonl(INADDR_ANY);
  }
  if (addr.family() == AF_INET6) {
    return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(addr.get())->sin6_addr);
  }
  return false;
}

bool isLoopbackHostPort(const std::string& address) {
  try {
    auto [host, port] = splitHostPort(address);
    if (host == "localhost") return true;
    in_addr a4;
    if (inet_pton(AF_INET, host.c_str(), &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
    in6_addr a6;
    if (inet_pton(AF_INET6, host.c_str(), &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
  } catch (const Exception&) {
  }
  return false;
}

void setNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  MOO_ENFORCE(flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0,
              "fcntl: ", errnoString(errno));
}

}  // namespace moolib
