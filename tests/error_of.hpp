#pragma once
// The message a call throws, for tests that check error text: what() of the
// exception, or "(no error)" when the call returns.
#include <exception>
#include <functional>
#include <string>

namespace test_util {
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}
}  // namespace test_util
