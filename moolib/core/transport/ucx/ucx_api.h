// The UCX functions the ucx transport uses, looked up at run time (dlopen of
// libucp.so.0): the extension never links UCX, so it loads and every other
// transport works where UCX is not installed. Compiled against UCX's headers
// when the build finds them, unless the build says MOOLIB_WITHOUT_UCX
// (setup.py's MOOLIB_UCX=0); without them, the transport says why it is off.
#pragma once

#if !defined(MOOLIB_WITHOUT_UCX) && __has_include(<ucp/api/ucp.h>) && \
    __has_include(<uct/api/uct.h>)
#define MOOLIB_UCX_HEADERS 1
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>
#else
#define MOOLIB_UCX_HEADERS 0
#endif

#include <string>

namespace moolib {

// For tests: dials a UCX address, sends bytes as they are (not a frame
// moolib made) and waits up to timeout seconds for the peer to close the
// connection. False when it could not connect.
bool ucxSendRaw(const std::string& address, const std::string& bytes, double timeoutSeconds);

#if MOOLIB_UCX_HEADERS
struct UcxApi {
  // clang-format off
#define MOOLIB_UCX_FUNCTIONS(X) \
  X(ucp_get_version_string) \
  X(ucp_config_read) \
  X(ucp_config_release) \
  X(ucp_init_version) \
  X(ucp_cleanup) \
  X(ucp_worker_create) \
  X(ucp_worker_destroy) \
  X(ucp_worker_get_efd) \
  X(ucp_worker_arm) \
  X(ucp_worker_progress) \
  X(ucp_listener_create) \
  X(ucp_listener_destroy) \
  X(ucp_listener_query) \
  X(ucp_listener_reject) \
  X(ucp_conn_request_query) \
  X(ucp_ep_create) \
  X(ucp_ep_close_nbx) \
  X(ucp_ep_print_info) \
  X(ucp_stream_send_nbx) \
  X(ucp_stream_recv_nbx) \
  X(ucp_request_free) \
  X(ucp_request_cancel) \
  X(ucs_status_string) \
  X(uct_query_components) \
  X(uct_release_component_list) \
  X(uct_component_query) \
  X(uct_md_config_read) \
  X(uct_config_release) \
  X(uct_md_open) \
  X(uct_md_close) \
  X(uct_md_query_tl_resources) \
  X(uct_release_tl_resource_list)
// clang-format on
#define MOOLIB_UCX_POINTER(name) decltype(&::name) name = nullptr;
  MOOLIB_UCX_FUNCTIONS(MOOLIB_UCX_POINTER)
#undef MOOLIB_UCX_POINTER
};

// The process's UCX functions, loaded on first use; nullptr with the reason
// when UCX cannot be loaded.
const UcxApi* loadUcx(std::string& whyNot);
#endif

}  // namespace moolib
