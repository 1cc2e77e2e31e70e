#pragma once
// A JSON document read as a whole (a topology, a model config): invalid JSON
// is a LayoutError naming where the text came from.
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "error.hpp"

namespace reshard {

/// Parses `text`, which came from `origin` (a file name).
inline nlohmann::json parse_json_text(const std::string& text, const std::string& origin) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw LayoutError(ErrorContext{origin, "", ""}, fmt::format("invalid JSON: {}", e.what()));
  }
}

}  // namespace reshard
