// The doctest main of the GPU test programs (tests/cuda.cmake). Their cases
// that need a GPU are in the test suite "gpu"; each program is registered
// with CTest twice:
//   <program>        the cases outside "gpu" (CPU only: op tables, errors)
//   <program>.gpu    `--gpu`: only the "gpu" cases. Without a visible GPU it
//                    prints why and exits 77, which CTest reports as skipped
//                    (SKIP_RETURN_CODE), never as passed.
// Either run fails when its selection holds no test case: a run that checked
// nothing must not read as a pass.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "reshard/cuda/runtime.hpp"

namespace {

/// How many test cases the run selected (doctest's own count, after filters).
struct SelectedCases : doctest::IReporter {
  static inline unsigned selected = 0;
  explicit SelectedCases(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& s) override { selected = s.numTestCasesPassingFilters; }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("selected-cases", 1, SelectedCases);

}  // namespace

int main(int argc, char** argv) {
  bool gpu = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (i > 0 && std::strcmp(argv[i], "--gpu") == 0)
      gpu = true;
    else
      args.push_back(argv[i]);
  }
  if (gpu && reshard::cuda::visible_devices() == 0) {
    std::printf("skipped: no GPU visible (cudaGetDeviceCount failed or returned 0); the \"gpu\" cases need one\n");
    return 77;
  }
  doctest::Context ctx(static_cast<int>(args.size()), args.data());
  ctx.addFilter(gpu ? "test-suite" : "test-suite-exclude", "gpu");
  const int rc = ctx.run();
  if (ctx.shouldExit()) return rc;
  if (SelectedCases::selected == 0) {
    std::printf("no test case selected (%s): this run checked nothing\n", gpu ? "--gpu" : "the cases outside the \"gpu\" suite");
    return 1;
  }
  return rc;
}
