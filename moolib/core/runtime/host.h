// Identity of this host as peers need it to choose a transport and to decide
// which advertised addresses are reachable.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moolib {

// Boot id plus network namespace: two processes with the same value can use
// the shared-memory transport (abstract Unix sockets are per namespace).
const std::string& hostIdentity();
// Non-loopback, non-link-local interface addresses (IPv4 and IPv6), as host strings.
std::vector<std::string> interfaceAddresses();
// A random hex string of n bytes of entropy.
std::string randomHex(size_t bytes);
// A random non-zero 64-bit number.
uint64_t randomU64();

}  // namespace moolib
