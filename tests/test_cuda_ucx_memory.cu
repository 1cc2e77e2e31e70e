// Does the UCX in use move CUDA memory? (cuda/ucx_memory.hpp). The answer
// must agree with the UCX installation: no CUDA transport module next to
// libucp (Debian's libucx) means host memory only; a CUDA module and a
// visible GPU mean CUDA memory.
#include <doctest/doctest.h>

#include <dlfcn.h>

#include <filesystem>
#include <string>

#include "reshard/cuda/runtime.hpp"
#include "reshard/cuda/ucx_memory.hpp"

namespace {

/// Is there a UCX CUDA transport module (libuct_cuda) beside the loaded libucp?
bool ucx_has_cuda_module(std::string& where) {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&ucp_init_version), &info) || !info.dli_fname) return false;
  const auto dir = std::filesystem::path(info.dli_fname).parent_path() / "ucx";
  where = dir.string();
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind("libuct_cuda", 0) == 0) return true;
  return false;
}

}  // namespace

TEST_CASE("UCX memory detection agrees with the installed UCX") {
  const auto m = reshard::cuda::probe_ucx_memory();
  MESSAGE(m.summary());
  CHECK(m.host);
  CHECK(!m.version.empty());
  std::string dir;
  const bool module = ucx_has_cuda_module(dir);
  INFO("UCX modules in ", dir);
  if (!module) {
    CHECK_FALSE(m.cuda);
    CHECK(m.summary().find("no CUDA") != std::string::npos);
  } else if (reshard::cuda::visible_devices() > 0) {
    CHECK(m.cuda);
  } else {
    MESSAGE("UCX has a CUDA module but no GPU is visible: cuda = " << m.cuda);
  }
}

TEST_CASE("a null context is a clear error") {
  std::string e;
  try {
    reshard::cuda::ucx_memory(nullptr);
  } catch (const std::exception& x) {
    e = x.what();
  }
  CHECK(e.find("the UCP context is null") != std::string::npos);
}
