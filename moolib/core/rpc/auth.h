// Challenge-response authentication with a shared key.
//
// Handshake, per connection (frames kHello and kAuth, parsed without pickle):
//  1. Each side sends kHello: wire version, a fresh 32-byte nonce, its role
//     (the side that dialed is the client), whether it holds a key, and its
//     host identity (so identify can leave out addresses only it can use).
//  2. The client proves first: HMAC-SHA256(key, "moolib-auth-v1" | role |
//     server nonce | client nonce). The server checks it, then proves with
//     its own role and the nonces in its order.
//  3. Only after both proofs (or when neither side has a key) do the peers
//     exchange kIdentify and any payload. A side with a key never accepts a
//     peer without one, and a nonce equal to one of our own is rejected, so a
//     proof cannot be reflected back to us.
#pragma once

#include <string>

namespace moolib {

constexpr size_t kNonceBytes = 32;

std::string makeNonce();
// role is "client" or "server": the role of the side producing the proof.
std::string authProof(const std::string& key, const std::string& role,
                      const std::string& verifierNonce, const std::string& proverNonce);
bool constantTimeEqual(const std::string& a, const std::string& b);

}  // namespace moolib
