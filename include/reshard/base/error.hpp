#pragma once
// Errors: one exception type whose message names where the fault is
// (file, tensor, field), so a harness can print it as the single stderr line.
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace reshard {

/// Where a fault sits in a layout description: the file (or "layout written in code"),
/// the tensor or buffer, and the field path inside it (e.g. "dims[1].split").
struct ErrorContext {
  std::string file = "layout written in code";
  std::string tensor;
  std::string field;
};

/// Any invalid layout, plan request or use of the library.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// An invalid layout: the message reads "FILE: tensor 'T': FIELD: what".
class LayoutError : public Error {
 public:
  LayoutError(const ErrorContext& ctx, const std::string& what)
      : Error(format(ctx, what)), context(ctx) {}
  ErrorContext context;

 private:
  static std::string format(const ErrorContext& c, const std::string& what) {
    std::string s = c.file + ": ";
    if (!c.tensor.empty()) s += "tensor '" + c.tensor + "': ";
    if (!c.field.empty()) s += c.field + ": ";
    return s + what;
  }
};

/// Throws LayoutError with a fmt-formatted message.
template <class... Args>
[[noreturn]] inline void layout_fail(const ErrorContext& ctx, fmt::format_string<Args...> f,
                                     Args&&... args) {
  throw LayoutError(ctx, fmt::format(f, std::forward<Args>(args)...));
}

template <class... Args>
[[noreturn]] inline void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace reshard
