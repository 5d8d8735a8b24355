#include "transport/ucx/ucx_api.h"

#if MOOLIB_UCX_HEADERS
#include <dlfcn.h>

#include <mutex>

#include "runtime/error.h"

namespace moolib {

const UcxApi* loadUcx(std::string& whyNot) {
  static std::once_flag once;
  static UcxApi api;
  static std::string error;
  static bool loaded = false;
  std::call_once(once, [] {
    // libucp pulls in libucs and libuct; their symbols are looked up in each.
    const char* libraries[] = {"libucp.so.0", "libucs.so.0", "libuct.so.0"};
    void* handles[3] = {};
    for (int i = 0; i != 3; ++i) {
      handles[i] = ::dlopen(libraries[i], RTLD_NOW | RTLD_LOCAL);
      if (!handles[i]) {
        const char* e = ::dlerror();
        error = concat("cannot load ", libraries[i],
                       " (install libucx0 or a system UCX): ", e ? e : "unknown error");
        return;
      }
    }
    auto find = [&](const char* name) -> void* {
      for (void* h : handles) {
        if (void* p = ::dlsym(h, name)) return p;
      }
      return nullptr;
    };
#define MOOLIB_UCX_LOOKUP(name)                                            \
  api.name = reinterpret_cast<decltype(api.name)>(find(#name));            \
  if (!api.name) {                                                         \
    error = concat("the UCX found lacks ", #name, " (needs UCX >= 1.10)"); \
    return;                                                                \
  }
    MOOLIB_UCX_FUNCTIONS(MOOLIB_UCX_LOOKUP)
#undef MOOLIB_UCX_LOOKUP
    // The handles stay open for the life of the process.
    loaded = true;
  });
  if (!loaded) {
    whyNot = error;
    return nullptr;
  }
  return &api;
}

}  // namespace moolib
#endif
