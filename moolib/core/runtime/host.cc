#include "runtime/host.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/random.h>
#include <unistd.h>

#include <climits>
#include <fstream>
#include <random>
#include <sstream>

#include "runtime/error.h"

namespace moolib {

const std::string& hostIdentity() {
  static const std::string id = [] {
    std::string boot;
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::getline(f, boot);
    if (boot.empty()) {
      char name[HOST_NAME_MAX + 1] = {0};
      ::gethostname(name, sizeof(name) - 1);
      boot = name;
    }
    char ns[128] = {0};
    ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
    return boot + "/" + (n > 0 ? std::string(ns, size_t(n)) : std::string("net"));
  }();
  return id;
}

std::vector<std::string> interfaceAddresses() {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || !(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
    char host[INET6_ADDRSTRLEN] = {0};
    if (i->ifa_addr->sa_family == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(i->ifa_addr);
      inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
      out.push_back(host);
    } else if (i->ifa_addr->sa_family == AF_INET6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(i->ifa_addr);
      if (IN6_IS_ADDR_LINKLOCAL(&a->sin6_addr)) continue;
      inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
      out.push_back(concat("[", host, "]"));
    }
  }
  ::freeifaddrs(list);
  return out;
}

uint64_t randomU64() {
  while (true) {
    uint64_t v = 0;
    MOO_ENFORCE(::getrandom(&v, sizeof(v), 0) == ssize_t(sizeof(v)), "getrandom failed");
    if (v != 0) return v;
  }
}

std::string randomHex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t got = 0;
  while (got < bytes) {
    ssize_t r = ::getrandom(raw.data() + got, bytes - got, 0);
    if (r <= 0) break;
    got += size_t(r);
  }
  MOO_ENFORCE(got == bytes, "getrandom failed");
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

}  // namespace moolib
