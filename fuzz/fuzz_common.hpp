#pragma once
// Shared by the fuzz targets: how a finding is reported. A finding prints
// what broke and the input in words, then aborts, which libFuzzer (and the
// replay driver under CTest) turns into a failure with the input saved.
#include <cstdio>
#include <cstdlib>
#include <string>

namespace fuzzgen {

[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "\nreshard fuzz finding: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace fuzzgen
