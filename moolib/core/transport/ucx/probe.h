// UcxProbe: whether the UCX transport can run here, and what it reaches.
#pragma once

#include "transport/ucx/ucx_api.h"

#if MOOLIB_UCX_HEADERS

#include <string>

namespace moolib {

// What UCX offers in this process, found once (loading UCX but starting
// nothing): its functions, the handshake's domain descriptor (UCX's
// transports and devices) and whether it has an RDMA device.
struct UcxProbe {
  static const UcxProbe& get();
  const UcxApi* api = nullptr;  // nullptr: not available, see whyNot
  std::string whyNot;
  std::string domain;
  bool rdma = false;
};

}  // namespace moolib

#endif
