#pragma once
// Which memory the UCX in use can move: host only (Debian's libucx) or also
// CUDA device memory (a UCX built with CUDA, e.g. the libucx-cu13 wheel, on a
// machine whose CUDA driver it could load). Asked of UCP itself at run time
// (ucp_context_query, UCP_ATTR_FIELD_MEMORY_TYPES), not guessed from the
// build: the same binary may load either library.
//
//   auto m = reshard::cuda::probe_ucx_memory();   // a throwaway UCP context
//   if (m.cuda) ...bind MemoryKind::device buffers to a UcxTransport...
//   fmt::print("{}\n", m.summary());               // "UCX 1.13.1 moves host memory only (no CUDA)"
//
// Plain C++; link ucx::ucp (and ucx::ucs).
#include <cstdint>
#include <string>

#include <fmt/format.h>
#include <ucp/api/ucp.h>

#include "../base/error.hpp"

namespace reshard::cuda {

struct UcxMemory {
  bool host = false, cuda = false, cuda_managed = false, rocm = false;
  std::uint64_t mask = 0;  ///< UCS_BIT(ucs_memory_type_t) per type UCP reports
  std::string version;     ///< of the loaded libucp
  std::string summary() const {
    if (cuda) return fmt::format("UCX {} moves CUDA device memory{}", version, cuda_managed ? " (and managed memory)" : "");
    return fmt::format("UCX {} moves host memory only (no CUDA)", version);
  }
};

/// The memory types of an existing UCP context.
inline UcxMemory ucx_memory(ucp_context_h ctx) {
  if (!ctx) fail("ucx memory query: the UCP context is null");
  ucp_context_attr_t a{};
  a.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  const ucs_status_t st = ucp_context_query(ctx, &a);
  if (st != UCS_OK) fail("ucx memory query: ucp_context_query failed: {}", ucs_status_string(st));
  UcxMemory m;
  m.mask = a.memory_types;
  m.host = (m.mask & UCS_BIT(UCS_MEMORY_TYPE_HOST)) != 0;
  m.cuda = (m.mask & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  m.cuda_managed = (m.mask & UCS_BIT(UCS_MEMORY_TYPE_CUDA_MANAGED)) != 0;
  m.rocm = (m.mask & UCS_BIT(UCS_MEMORY_TYPE_ROCM)) != 0;
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  m.version = fmt::format("{}.{}.{}", major, minor, release);
  return m;
}

/// Creates a short-lived UCP context (no worker, no network traffic) and
/// reports what it can move.
inline UcxMemory probe_ucx_memory() {
  ucp_config_t* cfg = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &cfg);
  if (st != UCS_OK) fail("ucx memory query: ucp_config_read failed: {}", ucs_status_string(st));
  ucp_params_t p{};
  p.field_mask = UCP_PARAM_FIELD_FEATURES;
  p.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA;
  ucp_context_h ctx = nullptr;
  st = ucp_init(&p, cfg, &ctx);
  ucp_config_release(cfg);
  if (st != UCS_OK) fail("ucx memory query: ucp_init failed: {}", ucs_status_string(st));
  UcxMemory m;
  try {
    m = ucx_memory(ctx);
  } catch (...) {
    ucp_cleanup(ctx);
    throw;
  }
  ucp_cleanup(ctx);
  return m;
}

}  // namespace reshard::cuda
