#include "rpc/auth.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include "runtime/error.h"

namespace moolib {

std::string makeNonce() {
  std::string nonce(kNonceBytes, '\0');
  size_t got = 0;
  while (got < kNonceBytes) {
    ssize_t r = ::getrandom(nonce.data() + got, kNonceBytes - got, 0);
    MOO_ENFORCE(r > 0, "getrandom failed");
    got += size_t(r);
  }
  return nonce;
}

std::string authProof(const std::string& key, const std::string& role,
                      const std::string& verifierNonce, const std::string& proverNonce) {
  std::string message = "moolib-auth-v1|" + role + "|" + verifierNonce + proverNonce;
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), int(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &len);
  return std::string(reinterpret_cast<char*>(out), len);
}

bool constantTimeEqual(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i != a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace moolib
