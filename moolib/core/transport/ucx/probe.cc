#include "transport/ucx/probe.h"

#if MOOLIB_UCX_HEADERS

#include <cstdlib>
#include <vector>

#include "runtime/error.h"

namespace moolib {

const UcxProbe& UcxProbe::get() {
  static const UcxProbe probe = [] {
    UcxProbe p;
    if (const char* off = std::getenv("MOOLIB_UCX"); off && std::string(off) == "0") {
      p.whyNot = "turned off by MOOLIB_UCX=0";
      return p;
    }
    // UCX installs handlers for SIGSEGV, SIGBUS, ... when loaded unless told
    // otherwise; they would replace Python's (faulthandler). And it takes
    // SIGHUP (UCX_DEBUG_SIGNO) to print debug information: a launcher whose
    // terminal went away would go on running. A value the user set is kept.
    ::setenv("UCX_HANDLE_ERRORS", "none", 0);
    ::setenv("UCX_DEBUG_SIGNO", "0", 0);
    p.api = loadUcx(p.whyNot);
    if (!p.api) return p;
    const UcxApi* api = p.api;
    // UCX's transports and devices here (uct), and whether one of them is an
    // RDMA network: a network transport other than TCP.
    std::string devices;
    uct_component_h* components = nullptr;
    unsigned numComponents = 0;
    if (api->uct_query_components(&components, &numComponents) == UCS_OK) {
      for (unsigned i = 0; i != numComponents; ++i) {
        uct_component_attr_t attr{};
        attr.field_mask =
            UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
        if (api->uct_component_query(components[i], &attr) != UCS_OK) continue;
        std::vector<uct_md_resource_desc_t> mds(attr.md_resource_count);
        attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
        attr.md_resources = mds.data();
        if (mds.empty() || api->uct_component_query(components[i], &attr) != UCS_OK) continue;
        for (auto& md : mds) {
          uct_md_config_t* mdConfig = nullptr;
          if (api->uct_md_config_read(components[i], nullptr, nullptr, &mdConfig) != UCS_OK)
            continue;
          uct_md_h handle = nullptr;
          ucs_status_t st = api->uct_md_open(components[i], md.md_name, mdConfig, &handle);
          api->uct_config_release(mdConfig);
          if (st != UCS_OK) continue;
          uct_tl_resource_desc_t* tls = nullptr;
          unsigned numTls = 0;
          if (api->uct_md_query_tl_resources(handle, &tls, &numTls) == UCS_OK) {
            for (unsigned t = 0; t != numTls; ++t) {
              std::string tl = tls[t].tl_name;
              if (tls[t].dev_type == UCT_DEVICE_TYPE_NET && tl != "tcp") p.rdma = true;
              std::string item = tl + "/" + tls[t].dev_name;
              if (devices.size() + item.size() < 900) {
                devices += (devices.empty() ? "" : ",") + item;
              }
            }
            api->uct_release_tl_resource_list(tls);
          }
          api->uct_md_close(handle);
        }
      }
      api->uct_release_component_list(components);
    }
    // UCX_TLS may leave the RDMA transports out.
    if (const char* tls = std::getenv("UCX_TLS")) {
      std::string v = tls;
      bool mayUseRdma = v.empty() || v[0] == '^' || v.find("all") != std::string::npos;
      for (const char* t : {"rc", "ud", "dc", "ib"}) mayUseRdma |= v.find(t) != std::string::npos;
      if (!mayUseRdma) p.rdma = false;
    }
    // For tests of the choice on machines without RDMA: count UCX's devices
    // here as RDMA-capable.
    if (const char* v = std::getenv("MOOLIB_UCX_ASSUME_RDMA"); v && std::string(v) == "1") {
      p.rdma = true;
    }
    p.domain = concat("rdma=", p.rdma ? 1 : 0, ";", devices);
    return p;
  }();
  return probe;
}

}  // namespace moolib

#endif
